"""sim quantizers: the bytes of trace_lightning.quant, and the parity-bit record layout."""

import pytest
import torch

from trace_lightning import sim
from trace_lightning.quant import quantize_mxfp4, quantize_nvfp4, row_global_scale


def test_rows_quantizer_is_quant_with_row_global() -> None:
    x = torch.randn(3, 7, 64, generator=torch.Generator().manual_seed(0)) * 5
    ours, ref = sim.quantize_nvfp4_rows(x), quantize_nvfp4(x, row_global_scale(x))
    assert torch.equal(ours.packed, ref.packed) and torch.equal(ours.scale_bytes(), ref.scale_bytes())
    assert torch.equal(ours.global_scale, ref.global_scale) and ours.global_scale.shape == (3, 7, 1)


@pytest.mark.parametrize("mode", ["floor", "rceil"])
def test_mxfp4_is_quant(mode: str) -> None:
    x = torch.randn(4, 96, generator=torch.Generator().manual_seed(1))
    assert torch.equal(sim.quantize_mxfp4(x, mode).packed, quantize_mxfp4(x, mode).packed)


def test_pack_parity_bit_order() -> None:
    q = sim.quantize_nvfp4_rows(torch.randn(5, 32, generator=torch.Generator().manual_seed(2)))
    bits = sim.pack_parity(q.packed)
    assert bits.shape == (5, 4) and bits.dtype == torch.uint8
    unpacked = (bits.unsqueeze(-1).to(torch.int32) >> torch.arange(8)) & 1  # (5, 4, 8)
    assert torch.equal(unpacked.flatten(-2).to(torch.uint8), q.codes() & 1)


def test_pack_parity_rejects_bad_input() -> None:
    with pytest.raises(ValueError):
        sim.pack_parity(torch.zeros(3, 6, dtype=torch.uint8))
