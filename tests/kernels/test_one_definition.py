"""The trainer's quantizers and the rollout's Triton kernels are one definition: same input, same bytes.

The trainer quantizes with trace_lightning.quant (its QAT hook's weights and activations); the engine runs
kernels.quantize_nvfp4 / fake_quantize_nvfp4_rows. Compared byte for byte (codes, scale bytes, globals) and, for
the values a forward uses, bit for bit, on the same device: under TRITON_INTERPRET=1 here, and on CUDA where a GPU
is present (tests/quant/test_one_definition.py shows the trainer's side does not change on CUDA).
"""

from __future__ import annotations

import pytest
import torch

from trace_lightning import kernels
from trace_lightning.guidance import FakeQuantHook
from trace_lightning.quant import NVFP4, parse_format, quantize_weight, tensor_global_scale


def _assert_same(a: NVFP4, b: NVFP4) -> None:
    assert torch.equal(a.packed, b.packed) and torch.equal(a.scale_bytes(), b.scale_bytes())
    assert torch.equal(a.global_scale.float().reshape(-1), b.global_scale.float().reshape(-1))


@pytest.mark.parametrize("shape", [(3, 96, 64), (128, 256)])
def test_trainer_weight_quantizer_equals_the_kernel(device: str, shape: tuple[int, ...]) -> None:
    """The QAT hook's weight (per-matrix global scale, per expert when stacked) against the kernel given that
    scale: what the engine would compute with if it quantized weights on the device."""
    w = (torch.randn(shape, generator=torch.Generator().manual_seed(len(shape))) / 16).to(device)
    trainer = quantize_weight(w, "nvfp4")
    g = tensor_global_scale(w, dims=2)
    kernel = kernels.quantize_nvfp4(w, g.reshape(*w.shape[:-2], 1, 1) if w.dim() > 2 else g)
    _assert_same(trainer, kernel)
    hook_value = FakeQuantHook("nvfp4").weight(w, layer=0, name="w")
    assert torch.equal(hook_value, kernel.dequantize(w.dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_trainer_activation_fake_quant_equals_the_kernel(device: str, dtype: torch.dtype) -> None:
    """fp4_qat's activation site (FakeQuantHook: training's own row-global scales) against the engine's fused
    quantizer: codes, scale bytes and row globals, and the forward value."""
    gen = torch.Generator().manual_seed(5)
    x = (torch.randn(2, 7, 128, generator=gen) * torch.logspace(-4, 4, 7)[None, :, None]).to(dtype).to(device)
    x[0, 0, :16] = 0.0  # an all-zero block
    value, record = kernels.fake_quantize_nvfp4_rows(x)
    _assert_same(parse_format("nvfp4").quantize(x), record)
    trainer_value = FakeQuantHook("nvfp4").activation(x, layer=0, site="attn_in")
    if dtype == torch.float32 or device == "cuda":
        assert torch.equal(trainer_value, value)
    else:  # the CPU interpreter casts float32 -> bf16 by truncation, not RNE (test_quantize.py): values in fp32
        assert torch.equal(trainer_value.float(), record.dequantize().to(dtype).float())
