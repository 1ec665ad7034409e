"""MXFP4 codes, E8M0 scale bytes and dequantized values are bit-identical with torchao 0.18 `to_mx` (FLOOR, RCEIL)."""

from __future__ import annotations

import pytest
import torch
from torch import Tensor
from torchao.prototype.mx_formats.config import ScaleCalculationMode
from torchao.prototype.mx_formats.mx_tensor import MXTensor, get_fp_scale, to_dtype, to_mx

from trace_lightning.quant import MXFP4, FP4Format, parse_format, quantize_mxfp4

DTYPES = [torch.float32, torch.bfloat16]
MODES = ["floor", "rceil"]


def torchao_mx(x: Tensor, mode: str) -> tuple[Tensor, Tensor]:
    return to_mx(x, torch.float4_e2m1fn_x2, 32, ScaleCalculationMode(mode))


def assert_same_bytes(ours: MXFP4, scales: Tensor, packed: Tensor) -> None:
    assert ours.scales.dtype == torch.float8_e8m0fnu and ours.packed.dtype == torch.uint8
    assert torch.equal(ours.scale_bytes(), scales.view(torch.uint8))
    assert torch.equal(ours.packed, packed.view(torch.uint8))


def int_bits(x: Tensor) -> Tensor:
    return x.view(torch.int16 if x.element_size() == 2 else torch.int32)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("mode", MODES)
def test_matches_torchao_to_mx(sample: Tensor, dtype: torch.dtype, mode: str) -> None:
    x = sample.to(dtype)
    ours = quantize_mxfp4(x, mode)
    assert_same_bytes(ours, *torchao_mx(x, mode))
    assert_same_bytes(FP4Format("mxfp4", mx_mode=mode).quantize(x), *torchao_mx(x, mode))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("mode", MODES)
def test_3d_inputs_match_torchao(sample: Tensor, dtype: torch.dtype, mode: str) -> None:
    x = sample.to(dtype).reshape(4, 4, 256)
    ours = quantize_mxfp4(x, mode)
    assert ours.packed.shape == (4, 4, 128) and ours.scales.shape == (4, 4, 8)
    assert_same_bytes(ours, *torchao_mx(x, mode))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("mode", MODES)
def test_dequantize_matches_torchao(sample: Tensor, dtype: torch.dtype, mode: str) -> None:
    x = sample.to(dtype)
    ours = quantize_mxfp4(x, mode).dequantize(dtype)
    assert ours.dtype == dtype
    scales, packed = torchao_mx(x, mode)
    assert torch.equal(int_bits(ours), int_bits(to_dtype(packed, scales, torch.float4_e2m1fn_x2, 32, dtype)))
    tensor = MXTensor.to_mx(x, torch.float4_e2m1fn_x2, 32, scaling_mode=ScaleCalculationMode(mode))
    assert torch.equal(int_bits(ours), int_bits(tensor.dequantize(dtype)))


@pytest.mark.parametrize("mode", MODES)
def test_every_reachable_e8m0_scale_byte_matches_torchao(mode: str) -> None:
    """Block maxima m * 2^e for every float32 exponent (subnormals included) and mantissas 1, 1.5 and 1.99."""
    exponents = torch.arange(-149, 128, dtype=torch.float32)
    amax = torch.cat([m * torch.exp2(exponents) for m in (1.0, 1.5, 1.99)])
    amax = amax[torch.isfinite(amax) & (amax > 0)]
    gen = torch.Generator().manual_seed(3)
    blocks = (torch.rand(amax.numel(), 32, generator=gen) * 2 - 1) * amax[:, None]
    blocks[:, 11] = -amax
    ours = quantize_mxfp4(blocks.reshape(1, -1), mode)
    assert_same_bytes(ours, *torchao_mx(blocks.reshape(1, -1), mode))
    reached = set(ours.scale_bytes().flatten().tolist())
    assert reached == set(range(0, 253 if mode == "floor" else 254))


def test_block_multiplier_of_every_scale_byte_equals_torchao() -> None:
    scale_bytes = torch.arange(256, dtype=torch.uint8).reshape(1, 256)
    q = MXFP4(packed=torch.zeros(1, 256 * 16, dtype=torch.uint8), scales=scale_bytes.view(torch.float8_e8m0fnu))
    theirs = get_fp_scale(scale_bytes)
    ours = q.block_multiplier()
    assert torch.isnan(ours[0, 255]) and torch.isnan(theirs[0, 255])
    assert torch.equal(int_bits(ours[:, :255]), int_bits(theirs[:, :255]))


def test_exact_ties_round_to_even() -> None:
    pattern = torch.tensor([6.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
    x = torch.cat((pattern, -pattern, pattern, -pattern)).reshape(1, 32) * 2.0**20
    expected = [7, 0, 2, 2, 4, 4, 6, 6, 15, 8, 10, 10, 12, 12, 14, 14] * 2
    for mode in MODES:
        ours = quantize_mxfp4(x, mode)
        assert ours.scale_bytes().item() == 127 + 20
        assert ours.codes().flatten().tolist() == expected
        assert_same_bytes(ours, *torchao_mx(x, mode))


def test_parse_format_names() -> None:
    assert parse_format("mxfp4") == FP4Format("mxfp4", "row", "floor")
    assert parse_format("mxfp4:rceil") == FP4Format("mxfp4", mx_mode="rceil")
    assert parse_format("nvfp4") == FP4Format("nvfp4", "row")
    assert parse_format("nvfp4:matrix").global_scale == "matrix"
    assert parse_format("nvfp4:none").global_scale == "none"
    assert FP4Format("mxfp4").block_size == 32 and FP4Format("nvfp4").block_size == 16
