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
from trace_lightning.quant import NVFP4, parse_format, quantize_weight
from trace_lightning.rollout.convert import fp4_checksum


def _assert_same(a: NVFP4, b: NVFP4) -> None:
    assert torch.equal(a.packed, b.packed) and torch.equal(a.scale_bytes(), b.scale_bytes())
    assert torch.equal(a.global_scale.float().reshape(-1), b.global_scale.float().reshape(-1))


@pytest.mark.parametrize("shape", [(3, 96, 64), (128, 256)])
def test_trainer_weight_quantizer_equals_the_kernel(device: str, shape: tuple[int, ...]) -> None:
    """The QAT hook's weight (per-matrix global scale, per expert when stacked) against the engine's weight
    quantizer on the Triton backend (kernels.quantize_weight: the reference's global, one kernel launch), down to
    the checksum the weight audit compares. One expert is all zeros and one row holds an outlier 2^12 times the
    rest: the global floor and a block scale at E4M3's top."""
    w = (torch.randn(shape, generator=torch.Generator().manual_seed(len(shape))) / 16).to(device)
    w[..., 0, 5] = 256.0
    if w.dim() > 2:
        w[1] = 0.0
    trainer = quantize_weight(w, "nvfp4")
    kernel = kernels.quantize_weight(w, "nvfp4")
    _assert_same(trainer, kernel)
    assert fp4_checksum(trainer) == fp4_checksum(kernel)
    hook_value = FakeQuantHook("nvfp4").weight(w, layer=0, name="w")
    assert torch.equal(hook_value, kernel.dequantize(w.dtype))


@pytest.mark.parametrize(("shape", "tiled"), [((2, 64, 256), True), ((96, 128), True), ((40, 144), False)])
def test_the_sync_writes_the_gemm_layout_as_the_trainer_quantizes(device: str, shape: tuple[int, ...],
                                                                 tiled: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """kernels.prepared_weight (what a weight sync runs per FP4 weight where the GEMMs read the word layout: CUDA,
    bf16) writes the word layout, and the tiles where the shape splits into them, in its quantizing launch: byte for
    byte the trainer's quantize_weight permuted by the table form of quant.words, and back to the same checksum.
    Off CUDA the kernels read stored order, so the word path is switched on here to run under the interpreter."""
    from trace_lightning.kernels import layout
    from trace_lightning.quant.words import WordNVFP4

    monkeypatch.setattr(layout, "prefers_word_layout", lambda dtype, device, cache=False: dtype == torch.bfloat16)
    w = (torch.randn(shape, generator=torch.Generator().manual_seed(sum(shape))) / 16).to(device)
    w[..., 3, 17] = 256.0
    trainer = quantize_weight(w, "nvfp4")
    held = kernels.prepared_weight(w, "nvfp4", torch.bfloat16)
    assert isinstance(held, WordNVFP4) and held.tiled == tiled
    want = WordNVFP4.from_stored(trainer, tiled)
    assert torch.equal(held.packed, want.packed)
    assert torch.equal(held.scales.view(torch.uint8), want.scales.view(torch.uint8))
    assert torch.equal(held.global_scale, want.global_scale)
    assert fp4_checksum(held.canonical()) == fp4_checksum(trainer)
    plain = kernels.prepared_weight(w, "nvfp4", torch.float32)  # no fast decoder for fp32 operands: stored order
    assert type(plain) is NVFP4
    _assert_same(plain, trainer)


def test_tiles_only_in_the_word_layout(device: str) -> None:
    with pytest.raises(ValueError, match="word layout"):
        kernels.quantize_nvfp4(torch.ones(32, 128, device=device), None, tiled=True)


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
