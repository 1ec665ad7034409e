"""One quantization definition on every device.

On CUDA, PyTorch divides a tensor by a Python number as a multiply by the number's float32 reciprocal (two
roundings); on the CPU it divides (one). A quantizer that divided by a Python number would give other bytes on a
GPU than on the CPU, and other bytes than the Triton kernels (which divide with div_rn). `CudaScalarDivision`
replays CUDA's rule on the CPU, so these tests show, without a GPU, that the quantizers' bytes do not depend on it.
"""

from __future__ import annotations

import weakref
from typing import Any

import pytest
import torch
from torch.overrides import TorchFunctionMode

from trace_lightning.guidance import FakeQuantHook
from trace_lightning.quant import (
    fake_quantize,
    parse_format,
    quantize_mxfp4,
    quantize_nvfp4,
    quantize_weight,
    row_global_scale,
    tensor_global_scale,
)
from trace_lightning.quant.guided import guided_quantize

_DIVISIONS = {torch.div, torch.true_divide, torch.Tensor.div, torch.Tensor.true_divide, torch.Tensor.__truediv__}
_FACTORIES = {torch.tensor, torch.as_tensor, torch.scalar_tensor, torch.full, torch.ones, torch.zeros, torch.empty,
              torch.arange, torch.linspace, torch.logspace}
"""Tensor factories: without a device argument they make a host (CPU) tensor, also when the code runs on a GPU."""


def _tensors(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, list | tuple):
        return [t for v in value for t in _tensors(v)]
    if isinstance(value, dict):
        return [t for v in value.values() for t in _tensors(v)]
    return []


class CudaScalarDivision(TorchFunctionMode):
    """Runs CPU code as if its inputs lived on a GPU, dividing as CUDA's TensorIterator does.

    Every tensor is a device tensor except those a factory made without a device argument (and what is computed
    from those alone): on a GPU they stay on the host. CUDA divides a device tensor by a Python number or by a 0-dim
    host tensor as x * (1.0f / float(d)) in float32 (two roundings); by a device tensor it divides (one rounding),
    as the CPU does. `divisions` counts the divisions of a device tensor it examined, `scalar_divisions` those by a
    scalar (a number or any 0-dim tensor), `replaced` those it computed the CUDA way (a host scalar divisor).
    """

    def __init__(self) -> None:
        super().__init__()
        self.replaced = self.scalar_divisions = self.divisions = 0
        self._host: weakref.WeakSet[torch.Tensor] = weakref.WeakSet()

    def _on_host(self, t: Any) -> bool:
        return isinstance(t, torch.Tensor) and t in self._host

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func in _DIVISIONS and len(args) == 2 and not kwargs and isinstance(args[0], torch.Tensor) \
                and args[0].is_floating_point() and not self._on_host(args[0]):
            x, d = args
            self.divisions += 1
            if isinstance(d, int | float) or (isinstance(d, torch.Tensor) and d.dim() == 0):
                self.scalar_divisions += 1
                if not isinstance(d, torch.Tensor) or self._on_host(d):
                    self.replaced += 1
                    inverse = torch.ones((), dtype=torch.float32) / torch.tensor(float(d), dtype=torch.float32)
                    return (x.float() * inverse).to(x.dtype)
        out = func(*args, **kwargs)
        inputs = _tensors(args) + _tensors(kwargs)
        host = kwargs.get("device") in (None, "cpu") if func in _FACTORIES else \
            bool(inputs) and all(self._on_host(t) for t in inputs)
        if host:
            for t in _tensors(out):
                self._host.add(t)
        return out


def _inputs() -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(64, 256, generator=gen) * torch.logspace(-3, 3, 64)[:, None]
    return [x, x.bfloat16(), (torch.rand(3, 32, 128, generator=gen) - 0.5) * 7]


def test_the_emulated_cuda_rule_differs_from_a_division() -> None:
    """The mode is not a no-op: dividing by 6 or 2688 the CUDA way (a Python number, a host scalar, or one computed
    from host scalars) rounds differently for many values; a divisor on the device divides."""
    x = torch.rand(10_000, generator=torch.Generator().manual_seed(0)) * 100
    with CudaScalarDivision() as mode:
        by_6, by_2688, by_host = x / 6.0, x / 2688.0, x / (torch.tensor(2.0) * 3.0)
        by_device = x / torch.full((), 6.0, device=x.device)
    assert (mode.replaced, mode.scalar_divisions) == (3, 4)
    assert (by_6 != x / torch.tensor(6.0)).sum() > 100 and (by_2688 != x / torch.tensor(2688.0)).sum() > 100
    assert torch.equal(by_host, by_6) and torch.equal(by_device, x / torch.tensor(6.0))


def _bytes(q: Any) -> list[torch.Tensor]:
    out = [q.packed, q.scale_bytes()]
    return out + ([q.global_scale] if getattr(q, "global_scale", None) is not None else [])


def _same(a: Any, b: Any) -> bool:
    return all(torch.equal(x, y) for x, y in zip(_bytes(a), _bytes(b), strict=True))


QUANTIZERS = {
    "row global": lambda t: quantize_nvfp4(t, row_global_scale(t)),
    "tensor global": lambda t: quantize_nvfp4(t, tensor_global_scale(t, dims=t.dim())),
    "no global": quantize_nvfp4,
    "weight": lambda t: quantize_weight(t, "nvfp4"),
    "mxfp4 floor": lambda t: quantize_mxfp4(t, "floor"),
    "mxfp4 rceil": lambda t: quantize_mxfp4(t, "rceil"),
}


def _differing_quantizers(x: torch.Tensor) -> list[str]:
    """The quantizers whose bytes change under CUDA's division rule. Each must divide under the mode's eyes, and
    all but MXFP4 floor (which divides only by its per-block scales) by a scalar, or the comparison would replay the
    same computation."""
    differ = []
    for name, quantize in QUANTIZERS.items():
        plain = quantize(x)
        with CudaScalarDivision() as mode:
            cuda_rule = quantize(x)
        assert mode.divisions > 0 and (mode.scalar_divisions > 0 or name == "mxfp4 floor"), (name, mode.divisions)
        if not _same(plain, cuda_rule):
            differ.append(name)
    return differ


@pytest.mark.parametrize("index", range(3))
def test_quantizers_give_the_same_bytes_under_cudas_division_rule(index: int) -> None:
    assert _differing_quantizers(_inputs()[index]) == []


@pytest.mark.parametrize("divide", [lambda x, d: x / d, lambda x, d: x / torch.tensor(d, dtype=x.dtype)],
                         ids=["python-number", "host-scalar"])
def test_a_quantizer_dividing_by_a_host_scalar_is_caught(monkeypatch: pytest.MonkeyPatch, divide: Any) -> None:
    """The planted bug the test exists for: blocks.divide written as x / 6.0, or as x / torch.tensor(6.0) (a host
    scalar on a GPU). The CUDA rule then changes the bytes of the row-global NVFP4 quantizer on these inputs, so
    test_quantizers_give_the_same_bytes_under_cudas_division_rule fails."""
    import trace_lightning.quant.mxfp4 as mxfp4
    import trace_lightning.quant.nvfp4 as nvfp4

    monkeypatch.setattr(nvfp4, "divide", divide)
    monkeypatch.setattr(mxfp4, "divide", divide)
    differ = {name for x in _inputs() for name in _differing_quantizers(x)}
    assert "row global" in differ, differ


def test_trainer_forward_values_are_the_same_under_cudas_division_rule() -> None:
    """Fake-quant (fp4_qat), guided rounding (trace) and the training hook's weights: the values training uses."""
    x = _inputs()[0]
    gen = torch.Generator().manual_seed(1)
    ref = parse_format("nvfp4").quantize(x + 0.01 * torch.randn(x.shape, generator=gen))
    w = torch.randn(4, 96, 64, generator=gen)
    paths = [lambda: fake_quantize(x, "nvfp4"), lambda: guided_quantize(x, ref, "parity").codes(),
             lambda: FakeQuantHook("nvfp4").weight(w, layer=0, name="w")]  # a fresh hook: no step's cache
    scalar_divisions = []
    for path in paths:
        plain = path()
        with CudaScalarDivision() as mode:
            cuda_rule = path()
        assert mode.divisions > 0 and torch.equal(plain, cuda_rule)
        scalar_divisions.append(mode.scalar_divisions)
    assert scalar_divisions[0] > 0 and scalar_divisions[2] > 0  # guided rounding divides by the record's scales
