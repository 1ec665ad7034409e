"""One quantization definition on every device.

On CUDA, PyTorch divides a tensor by a Python number as a multiply by the number's float32 reciprocal (two
roundings); on the CPU it divides (one). A quantizer that divided by a Python number would give other bytes on a
GPU than on the CPU, and other bytes than the Triton kernels (which divide with div_rn). `CudaScalarDivision`
replays CUDA's rule on the CPU, so these tests show, without a GPU, that the quantizers' bytes do not depend on it.
"""

from __future__ import annotations

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


class CudaScalarDivision(TorchFunctionMode):
    """Tensor / Python number computed as CUDA's TensorIterator does: x * (1.0f / float(d)) in float32."""

    def __init__(self) -> None:
        super().__init__()
        self.replaced = 0

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if (func in _DIVISIONS and len(args) == 2 and not kwargs and isinstance(args[1], int | float)
                and isinstance(args[0], torch.Tensor) and args[0].is_floating_point()):
            self.replaced += 1
            x = args[0]
            inverse = torch.ones((), dtype=torch.float32) / torch.tensor(float(args[1]), dtype=torch.float32)
            return (x.float() * inverse).to(x.dtype)
        return func(*args, **kwargs)


def _inputs() -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(64, 256, generator=gen) * torch.logspace(-3, 3, 64)[:, None]
    return [x, x.bfloat16(), (torch.rand(3, 32, 128, generator=gen) - 0.5) * 7]


def test_the_emulated_cuda_rule_differs_from_a_division() -> None:
    """The mode is not a no-op: dividing by 6 or 2688 the CUDA way rounds differently for many values."""
    x = torch.rand(10_000, generator=torch.Generator().manual_seed(0)) * 100
    with CudaScalarDivision() as mode:
        by_6, by_2688 = x / 6.0, x / 2688.0
    assert mode.replaced == 2
    assert (by_6 != x / torch.tensor(6.0)).sum() > 100 and (by_2688 != x / torch.tensor(2688.0)).sum() > 100


def _bytes(q: Any) -> list[torch.Tensor]:
    out = [q.packed, q.scale_bytes()]
    return out + ([q.global_scale] if getattr(q, "global_scale", None) is not None else [])


def _same(a: Any, b: Any) -> bool:
    return all(torch.equal(x, y) for x, y in zip(_bytes(a), _bytes(b), strict=True))


@pytest.mark.parametrize("index", range(3))
def test_quantizers_give_the_same_bytes_under_cudas_division_rule(index: int) -> None:
    x = _inputs()[index]
    quantizers = {
        "row global": lambda t: quantize_nvfp4(t, row_global_scale(t)),
        "tensor global": lambda t: quantize_nvfp4(t, tensor_global_scale(t, dims=t.dim())),
        "no global": quantize_nvfp4,
        "weight": lambda t: quantize_weight(t, "nvfp4"),
        "mxfp4 floor": lambda t: quantize_mxfp4(t, "floor"),
        "mxfp4 rceil": lambda t: quantize_mxfp4(t, "rceil"),
    }
    for name, quantize in quantizers.items():
        plain = quantize(x)
        with CudaScalarDivision():
            cuda_rule = quantize(x)
        assert _same(plain, cuda_rule), name


def test_trainer_forward_values_are_the_same_under_cudas_division_rule() -> None:
    """Fake-quant (fp4_qat), guided rounding (trace) and the training hook's weights: the values training uses."""
    x = _inputs()[0]
    gen = torch.Generator().manual_seed(1)
    ref = parse_format("nvfp4").quantize(x + 0.01 * torch.randn(x.shape, generator=gen))
    hook = FakeQuantHook("nvfp4")
    w = torch.randn(4, 96, 64, generator=gen)
    plain = [fake_quantize(x, "nvfp4"), guided_quantize(x, ref, "parity").codes(), hook.weight(w, layer=0, name="w")]
    with CudaScalarDivision():
        cuda_rule = [fake_quantize(x, "nvfp4"), guided_quantize(x, ref, "parity").codes(),
                     hook.weight(w, layer=0, name="w")]
    for a, b in zip(plain, cuda_rule, strict=True):
        assert torch.equal(a, b)
