"""NVFP4 codes, scale bytes and dequantized values are bit-identical with torchao 0.18 `nvfp4_quantize`."""

from __future__ import annotations

import pytest
import torch
from torch import Tensor
from torchao.prototype.mx_formats.nvfp4_tensor import NVFP4Tensor, nvfp4_quantize, per_tensor_amax_to_scale

from trace_lightning.quant import NVFP4, FP4Format, quantize_nvfp4, row_global_scale, tensor_global_scale
from trace_lightning.quant.nvfp4 import GLOBAL_SCALE_FLOOR

DTYPES = [torch.float32, torch.bfloat16]


def assert_same_bytes(ours: NVFP4, scales: Tensor, packed: Tensor) -> None:
    assert ours.scales.dtype == torch.float8_e4m3fn and ours.packed.dtype == torch.uint8
    assert torch.equal(ours.scale_bytes(), scales.view(torch.uint8).reshape(ours.scale_bytes().shape))
    assert torch.equal(ours.packed, packed.view(torch.uint8).reshape(ours.packed.shape))


def int_bits(x: Tensor) -> Tensor:
    return x.view(torch.int16 if x.element_size() == 2 else torch.int32)


def torchao_scalar_global(x: Tensor) -> Tensor:
    """torchao's per-tensor scale; below our documented 2^-120 floor torchao's own output is NaN-derived."""
    return per_tensor_amax_to_scale(x.float().abs().amax()).clamp(min=GLOBAL_SCALE_FLOOR)


@pytest.mark.parametrize("dtype", DTYPES)
def test_no_global_scale_matches_torchao(sample: Tensor, dtype: torch.dtype) -> None:
    x = sample.to(dtype)
    assert_same_bytes(quantize_nvfp4(x), *nvfp4_quantize(x))


@pytest.mark.parametrize("dtype", DTYPES)
def test_scalar_global_scale_matches_torchao(sample: Tensor, dtype: torch.dtype) -> None:
    x = sample.to(dtype)
    g = torchao_scalar_global(x)
    assert_same_bytes(quantize_nvfp4(x, g), *nvfp4_quantize(x, per_tensor_scale=g))
    assert_same_bytes(quantize_nvfp4(x, float(g)), *nvfp4_quantize(x, per_tensor_scale=g))


@pytest.mark.parametrize("dtype", DTYPES)
def test_row_global_scale_matches_torchao(sample: Tensor, dtype: torch.dtype) -> None:
    x = sample.to(dtype)
    g = row_global_scale(x)
    assert g.shape == (16, 1)
    assert_same_bytes(quantize_nvfp4(x, g), *nvfp4_quantize(x, per_tensor_scale=g))
    assert_same_bytes(FP4Format("nvfp4", "row").quantize(x), *nvfp4_quantize(x, per_tensor_scale=g))


@pytest.mark.parametrize("dtype", DTYPES)
def test_dequantize_matches_torchao_nvfp4_tensor(sample: Tensor, dtype: torch.dtype) -> None:
    x = sample.to(dtype)
    ours = quantize_nvfp4(x).dequantize(dtype)
    assert ours.dtype == dtype
    assert torch.equal(int_bits(ours), int_bits(NVFP4Tensor.to_nvfp4(x).dequantize(dtype)))
    g = row_global_scale(x)  # torchao's tensor takes [E, 1, 1] scales: one "expert" per row
    theirs = NVFP4Tensor.to_nvfp4(x.reshape(16, 1, 256), per_tensor_scale=g.reshape(16, 1, 1))
    assert torch.equal(
        int_bits(quantize_nvfp4(x, g).dequantize(dtype)), int_bits(theirs.dequantize(dtype).reshape(16, 256))
    )


def test_row_global_scale_is_torchao_per_tensor_scale_of_each_row(sample: Tensor) -> None:
    amax = sample.abs().amax(dim=-1, keepdim=True)
    expected = per_tensor_amax_to_scale(amax).clamp(min=GLOBAL_SCALE_FLOOR)
    assert torch.equal(row_global_scale(sample), expected)
    big = amax.squeeze(-1) >= 2688 * 2.0**-120
    assert torch.equal(row_global_scale(sample)[big], per_tensor_amax_to_scale(amax)[big])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("global_scale", ["none", "scalar", "expert", "row"])
def test_3d_inputs_match_torchao(sample: Tensor, dtype: torch.dtype, global_scale: str) -> None:
    x = sample.to(dtype).reshape(2, 8, 256)
    if global_scale == "none":
        assert_same_bytes(quantize_nvfp4(x), *nvfp4_quantize(x))
    elif global_scale == "scalar":
        g = torchao_scalar_global(x)
        assert_same_bytes(quantize_nvfp4(x, g), *nvfp4_quantize(x, per_tensor_scale=g))
    elif global_scale == "expert":
        g = per_tensor_amax_to_scale(x.float().abs().amax(dim=(1, 2), keepdim=True)).clamp(min=GLOBAL_SCALE_FLOOR)
        assert_same_bytes(quantize_nvfp4(x, g), *nvfp4_quantize(x, per_tensor_scale=g))
    else:  # torchao flattens the leading dims, so its per-row scale is given as [rows, 1]
        g = row_global_scale(x)
        assert g.shape == (2, 8, 1)
        assert_same_bytes(quantize_nvfp4(x, g), *nvfp4_quantize(x.reshape(16, 256), per_tensor_scale=g.reshape(16, 1)))


@pytest.mark.parametrize("shape", [(4, 4, 64), (3, 8, 64), (1, 5, 32)])
def test_stacked_experts_matrix_format_uses_each_experts_own_scale(shape: tuple[int, int, int]) -> None:
    gen = torch.Generator().manual_seed(7)
    w = torch.randn(shape, generator=gen) * torch.logspace(-3, 3, shape[0])[:, None, None]
    per_expert = per_tensor_amax_to_scale(w.abs().amax(dim=(1, 2), keepdim=True))
    assert torch.equal(tensor_global_scale(w, dims=2).reshape(-1), per_expert.reshape(-1))
    ours = FP4Format("nvfp4", "matrix").quantize(w)
    assert_same_bytes(ours, *nvfp4_quantize(w, per_tensor_scale=per_expert))
    assert torch.equal(ours.global_scale.reshape(-1), per_expert.reshape(-1))
    assert torch.equal(
        ours.dequantize(), NVFP4Tensor.to_nvfp4(w, per_tensor_scale=per_expert).dequantize(torch.float32)
    )


def test_single_matrix_format_uses_one_scale() -> None:
    w = torch.randn(32, 64, generator=torch.Generator().manual_seed(8))
    g = per_tensor_amax_to_scale(w.abs().amax())
    assert torch.equal(tensor_global_scale(w), g.reshape(1))
    assert_same_bytes(FP4Format("nvfp4", "matrix").quantize(w), *nvfp4_quantize(w, per_tensor_scale=g))
    assert_same_bytes(FP4Format("nvfp4", "none").quantize(w), *nvfp4_quantize(w))


def test_every_reachable_e4m3_scale_byte_matches_torchao() -> None:
    """Blocks whose amax is 6x every E4M3 value: bytes below the clamp floor 2^-6 (0x08) all map onto it."""
    e4m3 = torch.arange(0x7F, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    gen = torch.Generator().manual_seed(9)
    blocks = torch.rand(0x7F, 16, generator=gen) * 2 - 1
    blocks[:, 3] = 1.0
    x = (blocks * (6 * e4m3)[:, None]).reshape(1, -1)
    ours = quantize_nvfp4(x)
    assert_same_bytes(ours, *nvfp4_quantize(x))
    expected = torch.clamp(torch.arange(0x7F, dtype=torch.uint8), min=0x08)
    assert torch.equal(ours.scale_bytes().flatten(), expected)
    g = torch.tensor(2.0**-9)
    assert_same_bytes(quantize_nvfp4(x * 2.0**-9, g), *nvfp4_quantize(x * 2.0**-9, per_tensor_scale=g))


def test_exact_ties_scale_onto_midpoints_and_round_to_even() -> None:
    pattern = torch.tensor([6.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
    x = torch.cat((pattern, -pattern)).reshape(1, 16) * 2.0**-3
    ours = quantize_nvfp4(x)
    assert ours.scales.float().item() == 2.0**-3
    assert ours.codes().flatten().tolist() == [7, 0, 2, 2, 4, 4, 6, 6, 15, 8, 10, 10, 12, 12, 14, 14]
    assert_same_bytes(ours, *nvfp4_quantize(x))


@pytest.mark.parametrize("with_global", [False, True])
def test_ties_sample_lands_exactly_on_midpoints(ties_sample: Tensor, with_global: bool) -> None:
    g = row_global_scale(ties_sample) if with_global else None
    if with_global:
        assert torch.equal(g, torch.full((16, 1), 2.0**-4))
    q = quantize_nvfp4(ties_sample, g)
    y = q.scale_input(ties_sample.reshape(16, 16, 16))[:, 2:]  # blocks after the first 32-block
    midpoints = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
    on_tie = torch.isin(y.abs(), midpoints)
    assert on_tie.sum().item() == 16 * 14 * 14
    assert_same_bytes(q, *nvfp4_quantize(ties_sample, per_tensor_scale=g))
