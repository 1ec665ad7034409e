"""Non-finite input never becomes a finite value, and all-zero rows (padding) quantize to exact zeros.

These are the two documented deviations from torchao: a block holding NaN or +-inf gets the NaN scale
(torchao gives +-inf blocks a finite scale and finite codes), and global scales are floored at 2^-120
(torchao's per-tensor scale of an all-zero row is 0, which makes the row NaN). Everything else about
such tensors stays byte-identical with torchao.
"""

from __future__ import annotations

import pytest
import torch
from torch import Tensor
from torchao.prototype.mx_formats.config import ScaleCalculationMode
from torchao.prototype.mx_formats.mx_tensor import to_mx
from torchao.prototype.mx_formats.nvfp4_tensor import NVFP4Tensor, nvfp4_quantize, per_tensor_amax_to_scale

from trace_lightning.quant import (
    FP4Format,
    fake_quantize,
    guided_quantize,
    parse_format,
    quantize_mxfp4,
    quantize_nvfp4,
    row_global_scale,
    tensor_global_scale,
)
from trace_lightning.quant.nvfp4 import GLOBAL_SCALE_FLOOR

NAN, INF = float("nan"), float("inf")


def poisoned(block: int, rows: int = 4, cols: int = 128) -> tuple[Tensor, Tensor]:
    """x [rows, cols] with NaN, +inf, -inf in one block each of rows 0..2, and the [rows, cols/block] bad mask."""
    x = torch.randn(rows, cols, generator=torch.Generator().manual_seed(5)) * 3
    spots = [(0, 3, NAN), (1, block + 5, INF), (2, 3 * block + 1, -INF)]
    bad = torch.zeros(rows, cols // block, dtype=torch.bool)
    for r, c, v in spots:
        x[r, c] = v
        bad[r, c // block] = True
    return x, bad


def assert_blocks(dq: Tensor, bad: Tensor, block: int) -> None:
    """Bad blocks are all NaN and every other block is all finite."""
    blocks = dq.reshape(*bad.shape, block)
    assert torch.isnan(blocks[bad]).all()
    assert torch.isfinite(blocks[~bad]).all()


def assert_good_blocks_match(
    ours_scales: Tensor, ours_packed: Tensor, scales: Tensor, packed: Tensor, bad: Tensor
) -> None:
    block_bytes = ours_packed.shape[-1] // bad.shape[-1]
    assert torch.equal(ours_scales[~bad], scales.view(torch.uint8)[~bad])
    ours_b = ours_packed.reshape(*bad.shape, block_bytes)
    theirs_b = packed.view(torch.uint8).reshape(*bad.shape, block_bytes)
    assert torch.equal(ours_b[~bad], theirs_b[~bad])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_nvfp4_without_global_scale_marks_only_the_bad_blocks(dtype: torch.dtype) -> None:
    x, bad = poisoned(16)
    x = x.to(dtype)
    q = quantize_nvfp4(x)
    assert (q.scale_bytes()[bad] == 0x7F).all()
    assert_blocks(q.dequantize(), bad, 16)
    assert_good_blocks_match(q.scale_bytes(), q.packed, *nvfp4_quantize(x), bad)


def test_nvfp4_row_global_scale_makes_a_poisoned_row_entirely_nan() -> None:
    x, _ = poisoned(16)
    g = row_global_scale(x)
    assert torch.isnan(g[0]).all() and torch.isinf(g[1]).all() and torch.isinf(g[2]).all()
    q = quantize_nvfp4(x, g)
    dq = q.dequantize()
    assert torch.isnan(dq[:3]).all()
    assert (q.scale_bytes()[:3] == 0x7F).all()
    assert torch.isfinite(dq[3]).all()
    scales, packed = nvfp4_quantize(x[3:], per_tensor_scale=g[3:])
    assert torch.equal(q.scale_bytes()[3:], scales.view(torch.uint8)) and torch.equal(q.packed[3:], packed)


def test_nvfp4_matrix_global_scale_of_a_poisoned_matrix_is_nan_everywhere() -> None:
    x, _ = poisoned(16)
    assert not torch.isfinite(tensor_global_scale(x)).any()
    assert torch.isinf(tensor_global_scale(torch.where(torch.isnan(x), 0.0, x))).all()
    assert torch.isnan(FP4Format("nvfp4", "matrix").quantize(x).dequantize()).all()
    experts = torch.stack((x, torch.ones_like(x)))
    dq = FP4Format("nvfp4", "matrix").quantize(experts).dequantize()
    assert torch.isnan(dq[0]).all() and torch.equal(dq[1], torch.ones_like(x))


@pytest.mark.parametrize("mode", ["floor", "rceil"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mxfp4_marks_only_the_bad_blocks(mode: str, dtype: torch.dtype) -> None:
    x, bad = poisoned(32)
    x = x.to(dtype)
    q = quantize_mxfp4(x, mode)
    assert (q.scale_bytes()[bad] == 255).all()
    assert_blocks(q.dequantize(), bad, 32)
    scales, packed = to_mx(x, torch.float4_e2m1fn_x2, 32, ScaleCalculationMode(mode))
    assert_good_blocks_match(q.scale_bytes(), q.packed, scales, packed, bad)


@pytest.mark.parametrize("fmt", ["nvfp4", "nvfp4:none", "mxfp4", "mxfp4:rceil"])
@pytest.mark.parametrize("mode", ["full", "parity"])
def test_guided_quantize_marks_blocks_where_training_input_is_nonfinite(fmt: str, mode: str) -> None:
    block = 32 if fmt.startswith("mx") else 16
    x, bad = poisoned(block)
    clean = torch.where(torch.isfinite(x), x, torch.zeros_like(x))
    ref = parse_format(fmt).quantize(clean)
    dq = guided_quantize(x, ref, mode).dequantize()
    assert_blocks(dq, bad, block)
    keep = (~bad).repeat_interleave(block, dim=-1)
    assert torch.equal(dq[keep], guided_quantize(clean, ref, mode).dequantize()[keep])
    fq = fake_quantize(x, fmt, ref=ref, mode=mode)
    assert_blocks(fq, bad, block)


def test_fake_quantize_of_nonfinite_input_is_nan() -> None:
    x, bad = poisoned(16)
    assert_blocks(fake_quantize(x, "nvfp4:none"), bad, 16)
    assert torch.isnan(fake_quantize(x, "nvfp4")[:3]).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_all_zero_rows_with_row_global_scale_quantize_to_exact_zeros(dtype: torch.dtype) -> None:
    x = torch.randn(4, 64, generator=torch.Generator().manual_seed(6)).to(dtype)
    x[1] = 0.0
    x[2] = -0.0
    g = row_global_scale(x)
    assert g[1].item() == g[2].item() == GLOBAL_SCALE_FLOOR
    q = quantize_nvfp4(x, g)
    dq = q.dequantize(dtype)
    assert torch.equal(dq[1:3], torch.zeros(2, 64, dtype=dtype))
    assert q.codes()[1].tolist() == [0] * 64 and q.codes()[2].tolist() == [8] * 64
    assert torch.signbit(dq[2]).all()
    assert torch.equal(fake_quantize(x, "nvfp4")[1:3], torch.zeros(2, 64, dtype=dtype))
    scales, packed = nvfp4_quantize(x, per_tensor_scale=g)
    assert torch.equal(q.scale_bytes(), scales.view(torch.uint8)) and torch.equal(q.packed, packed)


def test_torchao_unfloored_zero_row_scale_is_nan_which_the_floor_avoids() -> None:
    x = torch.zeros(1, 1, 32)
    g = per_tensor_amax_to_scale(x.abs().amax(dim=-1, keepdim=True))
    assert g.item() == 0.0
    assert torch.isnan(NVFP4Tensor.to_nvfp4(x, per_tensor_scale=g).dequantize(torch.float32)).all()
    assert torch.equal(quantize_nvfp4(x, row_global_scale(x)).dequantize(), x)


def test_all_zero_inputs_quantize_to_zeros_in_every_format() -> None:
    x = torch.zeros(2, 3, 64)
    for fmt in ("nvfp4", "nvfp4:matrix", "nvfp4:none", "mxfp4", "mxfp4:rceil"):
        dq = fake_quantize(x, fmt)
        assert torch.equal(dq, x), fmt
