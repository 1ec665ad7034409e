"""External oracles for the quant tests: torchao 0.18, ml_dtypes, and torch's own float4_e2m1fn_x2 reference.

torch 2.13 on CPU has the `torch.float4_e2m1fn_x2` dtype only as storage: `.to()` in either direction,
`.item()`, `.tolist()` and `torch.compile` casts all raise. What torch ships to build and read that dtype
is the reference in `torch/testing/_internal/common_quantized.py` (`_f32_to_floatx_unpacked`,
`_floatx_unpacked_to_f32`, `pack_uint4`, `_bfloat16_to_float4_e2m1fn_x2`, used by torch's own FP4
`_scaled_mm` tests). That module imports torch's test harness (which needs `expecttest`), so the
`torch_fp4` fixture compiles just those functions and constants out of the installed file.
"""

from __future__ import annotations

import ast
import importlib.util
import types
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import Tensor

warnings.filterwarnings("ignore")

_TORCH_FP4_NAMES = frozenset(
    {
        "_n_ones",
        "_f32_to_floatx_unpacked",
        "_floatx_unpacked_to_f32",
        "down_size",
        "pack_uint4",
        "_bfloat16_to_float4_e2m1fn_x2",
        "EBITS_F32",
        "MBITS_F32",
        "F32_EXP_BIAS",
        "FP4_EBITS",
        "FP4_MBITS",
    }
)


def _assigned_names(node: ast.Assign) -> list[str]:
    names = []
    for target in node.targets:
        for n in target.elts if isinstance(target, ast.Tuple) else [target]:
            if isinstance(n, ast.Name):
                names.append(n.id)
    return names


@pytest.fixture(scope="session")
def torch_fp4() -> types.SimpleNamespace:
    """torch's float4_e2m1fn_x2 reference functions, taken from the installed torch."""
    spec = importlib.util.find_spec("torch.testing._internal")
    assert spec is not None and spec.submodule_search_locations
    path = Path(next(iter(spec.submodule_search_locations))) / "common_quantized.py"
    tree = ast.parse(path.read_text())
    keep = [
        node
        for node in tree.body
        if (isinstance(node, ast.FunctionDef) and node.name in _TORCH_FP4_NAMES)
        or (isinstance(node, ast.Assign) and _assigned_names(node) and set(_assigned_names(node)) <= _TORCH_FP4_NAMES)
    ]
    namespace: dict[str, object] = {"torch": torch, "Tensor": Tensor, "np": np}
    exec(compile(ast.Module(body=keep, type_ignores=[]), str(path), "exec"), namespace)  # noqa: S102
    missing = _TORCH_FP4_NAMES - namespace.keys()
    assert not missing, f"torch's FP4 reference lacks {sorted(missing)}"
    return types.SimpleNamespace(**{k: namespace[k] for k in _TORCH_FP4_NAMES})


def _ties(gen: torch.Generator, rows: int, cols: int) -> Tensor:
    """Rows whose max is 168 (global scale exactly 2^-4) and whose other 32-blocks are 2^k times E2M1 midpoints.

    Every 16-block (and 32-block) after the first holds +-6 * 2^k, so its NVFP4 scale (with or without the
    global scale) and its MX scale are exact powers of two and each element scales exactly onto a tie.
    """
    pattern = torch.tensor([6.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
    pattern = torch.cat((pattern, -pattern))
    exponents = (-6, -4, -3, -1, 1, 3, 4)
    out = torch.empty(rows, cols)
    for r in range(rows):
        out[r, :32] = torch.randn(32, generator=gen)
        out[r, int(torch.randint(0, 32, (1,), generator=gen))] = 168.0
        for b in range(1, cols // 32):
            k = exponents[(b + r) % len(exponents)]
            for half in (0, 16):
                start = 32 * b + half
                out[r, start : start + 16] = pattern[torch.randperm(16, generator=gen)] * 2.0**k
    return out


def _distribution(name: str, rows: int = 16, cols: int = 256) -> Tensor:
    gen = torch.Generator().manual_seed(sum(map(ord, name)))
    normal = torch.randn(rows, cols, generator=gen)
    if name.startswith("normal_"):
        return normal * float(name.removeprefix("normal_"))
    if name == "log_spaced_rows":
        return normal * torch.logspace(-30, 30, rows)[:, None]
    if name == "student_t3":
        chi2 = torch.randn(3, rows, cols, generator=gen).square().sum(0)
        return normal / torch.sqrt(chi2 / 3.0)
    if name == "cauchy":
        return torch.tan(torch.pi * (torch.rand(rows, cols, generator=gen) - 0.5))
    if name == "zero_blocks":
        normal[:, 16:32] = 0.0
        normal[:, 96:128] = -0.0
        normal[3] = 0.0
        return normal
    if name == "outliers":
        small = normal * 1e-3
        small[:, 7::32] = torch.where(normal[:, 7::32] > 0, 1e4, -3e3)
        return small
    if name == "ties":
        return _ties(gen, rows, cols)
    if name == "subnormal":
        return normal * 1e-39
    raise AssertionError(name)


DISTRIBUTIONS = (
    *(f"normal_{m}" for m in ("1e-30", "1e-20", "1e-10", "1.0", "1e10", "1e20", "1e30")),
    "log_spaced_rows",
    "student_t3",
    "cauchy",
    "zero_blocks",
    "outliers",
    "ties",
    "subnormal",
)


@pytest.fixture(params=DISTRIBUTIONS)
def sample(request: pytest.FixtureRequest) -> Tensor:
    """A float32 [16, 256] input from one of the distributions the quantizers must match torchao on."""
    x = _distribution(request.param)
    assert torch.isfinite(x).all()
    return x


@pytest.fixture
def ties_sample() -> Tensor:
    return _distribution("ties")
