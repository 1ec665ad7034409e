"""sim quantizers: torchao 0.18's bytes and values, and the parity-bit record layout."""

import pytest
import torch

from trace_lightning import sim


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rows_quantizer_is_torchaos_nvfp4_with_a_row_global(dtype: torch.dtype, torchao_fp4) -> None:
    x = (torch.randn(3, 7, 64, generator=torch.Generator().manual_seed(0)) * 5).to(dtype)
    x[1, 2] = 0.0  # an all-zero row takes the documented floor global scale
    ours = sim.quantize_nvfp4_rows(x)
    packed, scale_bytes, global_scale = torchao_fp4.nvfp4_rows(x)
    assert torch.equal(ours.packed, packed) and torch.equal(ours.scale_bytes(), scale_bytes)
    assert torch.equal(ours.global_scale, global_scale) and ours.global_scale.shape == (3, 7, 1)
    values, record = sim.fake_quantize_nvfp4_rows(x)
    assert values.dtype == dtype and torch.equal(record.packed, packed)
    assert torch.equal(values.float(), torchao_fp4.nvfp4_rows_dequantized(x, dtype).float())


def test_given_global_scale_is_torchaos() -> None:
    from torchao.prototype.mx_formats.nvfp4_tensor import nvfp4_quantize

    x = torch.randn(4, 64, generator=torch.Generator().manual_seed(3)) * 5
    for g in (None, torch.tensor(0.01)):
        scales, packed = nvfp4_quantize(x, per_tensor_scale=g)
        ours = sim.quantize_nvfp4(x, g)
        assert torch.equal(ours.packed, packed.view(torch.uint8)) and torch.equal(ours.scale_bytes(),
                                                                                  scales.view(torch.uint8))


@pytest.mark.parametrize("mode", ["floor", "rceil"])
def test_mxfp4_is_torchaos(mode: str, torchao_fp4) -> None:
    x = torch.randn(4, 96, generator=torch.Generator().manual_seed(1)) * 3
    ours = sim.quantize_mxfp4(x, mode)
    packed, scale_bytes = torchao_fp4.mxfp4(x, mode)
    assert torch.equal(ours.packed, packed) and torch.equal(ours.scale_bytes(), scale_bytes)


def test_pack_parity_bit_order() -> None:
    q = sim.quantize_nvfp4_rows(torch.randn(5, 32, generator=torch.Generator().manual_seed(2)))
    bits = sim.pack_parity(q.packed)
    assert bits.shape == (5, 4) and bits.dtype == torch.uint8
    unpacked = (bits.unsqueeze(-1).to(torch.int32) >> torch.arange(8)) & 1  # (5, 4, 8)
    assert torch.equal(unpacked.flatten(-2).to(torch.uint8), q.codes() & 1)


def test_pack_parity_rejects_bad_input() -> None:
    with pytest.raises(ValueError):
        sim.pack_parity(torch.zeros(3, 6, dtype=torch.uint8))
