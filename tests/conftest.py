"""Shared test configuration: GPU tests skip cleanly without CUDA; hypothesis is derandomized in CI; sandbox
tests need bubblewrap, except off CI.

The coding sandbox refuses to run without `bwrap` (by design: nothing weaker is a boundary), so its test files
cannot even be imported there. On a machine without it they are left out with a notice in the header (except
tests/security/test_hostile_answers.py, which scores answers and never starts the sandbox); under CI
(CI=true, where .ci/run installs bubblewrap) nothing is left out, so a missing tool fails loudly.
"""

import logging
import os
import types
from pathlib import Path

# The oracles' import-time noise, before anything imports them: torchao logs "Failed to load" for each CUDA
# extension a CPU machine cannot load, and torch warns that torchao registers enums it no longer needs to.
logging.getLogger("torchao").setLevel(logging.ERROR)
logging.getLogger("torch.utils._pytree").setLevel(logging.ERROR)

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

if not torch.cuda.is_available():
    # Before anything imports triton.language (lightning, compressed-tensors and torchao all do): its standard
    # library is decorated then, and only when the interpreter is on does it run inside interpreted kernels.
    os.environ["TRITON_INTERPRET"] = "1"


def _position_independent_interpreter_dot() -> None:
    """Under TRITON_INTERPRET, `tl.dot` is `np.matmul` in float32, and OpenBLAS's sgemm kernels (its Haswell one,
    picked on some AMD hosts) round a column differently depending on its position in the tile. A GPU MMA treats
    every row and column alike, so kernel tests (e.g. "the order of pairs within an expert changes nothing") must
    not see that artefact. This dot sums in float64 and rounds once to the accumulator's dtype. Under the
    interpreter the kernels pass bf16-valued operands as float32 (kernels._common.mma_torch_dtype), and for those
    every product and partial sum of a tile is exact in float64, so the result is the correctly rounded dot
    wherever its row and column sit, whatever BLAS the host has (float32-valued operands: within 2^-53 before the
    one rounding, so equal but for ties at a float32 midpoint)."""
    from triton.runtime import interpreter

    original = interpreter.InterpreterBuilder.create_dot

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):  # noqa: ANN001, ANN202 (Triton's API)
        if a.data.dtype.kind != "f" or b.data.dtype.kind != "f":  # fp8 stored as ints: Triton's own conversion
            return original(self, a, b, d, input_precision, max_num_imprecise_acc)
        exact = np.matmul(a.data.astype(np.float64), b.data.astype(np.float64))
        return interpreter.TensorHandle(exact.astype(d.data.dtype) + d.data, d.dtype.scalar)

    interpreter.InterpreterBuilder.create_dot = create_dot


def _round_to_nearest_even_bf16_casts() -> None:
    """Under TRITON_INTERPRET a float32 -> bfloat16 cast truncates (Triton 3.9's interpreter drops the low bits);
    on a GPU, and in torch, it rounds to nearest even. Cast the way the hardware does, so bf16 results under the
    interpreter are the GPU's and can be compared bit for bit (torch's cast: RNE, NaN kept)."""
    from triton import language as tl
    from triton.runtime import interpreter

    original = interpreter.InterpreterBuilder.cast_impl

    def cast_impl(self, src, dst_type):  # noqa: ANN001, ANN202 (Triton's API)
        if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:
            rounded = torch.from_numpy(np.ascontiguousarray(src.data)).to(torch.bfloat16).view(torch.int16)
            return interpreter.TensorHandle(rounded.numpy().view(np.uint16), dst_type.scalar)
        return original(self, src, dst_type)

    interpreter.InterpreterBuilder.cast_impl = cast_impl


if not torch.cuda.is_available():  # every kernel a test runs, in any directory, rounds as the GPU does
    _position_independent_interpreter_dot()
    _round_to_nearest_even_bf16_casts()

from hypothesis import settings  # noqa: E402
from torch import Tensor  # noqa: E402

from trace_lightning.envs.isolation import bwrap_problem  # noqa: E402

# In CI every hypothesis test draws the same examples on every run: hypothesis's built-in "ci" profile
# (derandomize: the seed is a hash of the test's name; no example database, no deadline, print_blob) is loaded
# when a CI variable is set, and here explicitly for CI=true, so a red CI run replays locally with CI=true.
# Elsewhere examples stay random.
if os.environ.get("CI") == "true":
    settings.load_profile("ci")

_SANDBOX_TESTS = ("security", "envs/test_coding.py")
_WITHOUT_SANDBOX = ("security/test_hostile_answers.py",)
"""Files under tests/security that never start the sandbox (scoring of hostile answers): collected everywhere."""


def _sandbox_unavailable() -> str | None:
    return None if os.environ.get("CI") else bwrap_problem()


def pytest_ignore_collect(collection_path: Path, config: pytest.Config) -> bool | None:
    path = collection_path.as_posix()
    if not _sandbox_unavailable() or collection_path.is_dir() or any(path.endswith(p) for p in _WITHOUT_SANDBOX):
        return None  # a folder's files are decided one by one
    if any(path.endswith(p) or f"/{p}/" in path for p in _SANDBOX_TESTS):
        return True
    return None


def pytest_report_header(config: pytest.Config) -> list[str]:
    profile = settings.get_current_profile_name()
    seed = "a hash of each test's name" if settings.default.derandomize else "random (hypothesis prints it on failure)"
    lines = [f"hypothesis profile {profile!r}: seed {seed}"]
    problem = _sandbox_unavailable()
    if problem is not None:
        lines.append(f"sandbox tests left out ({', '.join(_SANDBOX_TESTS)}; not {', '.join(_WITHOUT_SANDBOX)}): "
                     f"{problem}")
    return lines


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture(scope="session")
def torchao_fp4() -> types.SimpleNamespace:
    """torchao 0.18's FP4 quantizers, the independent oracle for every wrapper around trace_lightning.quant.

    nvfp4_rows(x) -> (packed uint8 [..., K/2], scale bytes [..., K/16], global scale [..., 1]) with the per-row
    global scale amax / (448 * 6); nvfp4_rows_dequantized(x, dtype) its values; mxfp4(x, mode) -> (packed,
    scale bytes); dequantized(x, fmt, dtype) the values for a format name ("nvfp4", "nvfp4:none",
    "nvfp4:matrix", "mxfp4", "mxfp4:rceil").
    """
    from torchao.prototype.mx_formats.config import ScaleCalculationMode
    from torchao.prototype.mx_formats.mx_tensor import MXTensor, to_mx
    from torchao.prototype.mx_formats.nvfp4_tensor import NVFP4Tensor, nvfp4_quantize, per_tensor_amax_to_scale

    from trace_lightning.quant.nvfp4 import GLOBAL_SCALE_FLOOR  # the documented floor for all-zero rows

    def global_scale(x: Tensor, dims: tuple[int, ...]) -> Tensor:
        return per_tensor_amax_to_scale(x.float().abs().amax(dim=dims, keepdim=True)).clamp(min=GLOBAL_SCALE_FLOOR)

    def nvfp4_rows(x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        rows = x.reshape(-1, x.shape[-1])
        g = global_scale(rows, (-1,))
        scales, packed = nvfp4_quantize(rows, per_tensor_scale=g)
        lead = x.shape[:-1]
        return (packed.view(torch.uint8).reshape(*lead, -1), scales.view(torch.uint8).reshape(*lead, -1),
                g.reshape(*lead, 1))

    def nvfp4_rows_dequantized(x: Tensor, dtype: torch.dtype) -> Tensor:
        rows = x.reshape(-1, 1, x.shape[-1])  # one torchao "expert" per row carries the row's global scale
        g = global_scale(rows, (-1,))
        return NVFP4Tensor.to_nvfp4(rows, per_tensor_scale=g).dequantize(dtype).reshape(x.shape)

    def mxfp4(x: Tensor, mode: str) -> tuple[Tensor, Tensor]:
        scales, packed = to_mx(x, torch.float4_e2m1fn_x2, 32, ScaleCalculationMode(mode))
        return packed.view(torch.uint8), scales.view(torch.uint8)

    def dequantized(x: Tensor, fmt: str, dtype: torch.dtype) -> Tensor:
        kind, _, option = fmt.partition(":")
        if kind == "mxfp4":
            mode = ScaleCalculationMode(option or "floor")
            return MXTensor.to_mx(x, torch.float4_e2m1fn_x2, 32, scaling_mode=mode).dequantize(dtype)
        if option == "none":
            return NVFP4Tensor.to_nvfp4(x).dequantize(dtype)
        if option == "matrix":
            g = global_scale(x, (-2, -1)).reshape(())
            return NVFP4Tensor.to_nvfp4(x, per_tensor_scale=g).dequantize(dtype)
        return nvfp4_rows_dequantized(x, dtype)

    return types.SimpleNamespace(nvfp4_rows=nvfp4_rows, nvfp4_rows_dequantized=nvfp4_rows_dequantized, mxfp4=mxfp4,
                                 dequantized=dequantized)


def _unit_roundoff(dtype: torch.dtype) -> float:
    return {torch.float32: 0.0, torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}[dtype]


def assert_routes_match_float64(gates: Tensor, ids: Tensor, logits: Tensor, top_k: int, scoring: str,
                                normalize: bool) -> None:
    """(gates, ids) from logits [..., E] against the router computed in float64 (independent of the model's code).

    ids: their float64 scores are the float64 top-k, best first (robust to exactly tied logits). gates: float32
    scores carry a relative error of at most (E + 2) * 2^-24 (exp or sigmoid, a sum of E terms, one division),
    normalizing adds (K + 1) * 2^-24, and the cast to gates.dtype its unit roundoff (2^-8 for bf16).
    """
    E = logits.shape[-1]
    scores = logits.double().softmax(-1) if scoring == "softmax" else logits.double().sigmoid()
    best = scores.topk(top_k, dim=-1).values
    chosen = scores.gather(-1, ids)
    assert torch.equal(chosen, best), "ids are not the float64 router's top-k, best first"
    want = chosen / chosen.sum(-1, keepdim=True) if normalize else chosen
    rtol = (E + 2 + (top_k + 1 if normalize else 0)) * 2.0**-24 + _unit_roundoff(gates.dtype)
    torch.testing.assert_close(gates.double(), want, rtol=rtol, atol=0)


@pytest.fixture(scope="session")
def float64_router() -> object:
    return assert_routes_match_float64
