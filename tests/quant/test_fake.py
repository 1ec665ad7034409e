"""fake_quantize: forward is the dequantized FP4 value in x's dtype, backward is straight-through inside the range."""

from __future__ import annotations

import pytest
import torch
from torch import Tensor

from trace_lightning.quant import fake_quantize, parse_format, quantize

DTYPES = [torch.float32, torch.bfloat16]
FORMATS = ["nvfp4", "nvfp4:none", "nvfp4:matrix", "mxfp4", "mxfp4:rceil"]


E2M1_MAGNITUDES = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], dtype=torch.float64)


def bits(x: Tensor) -> Tensor:
    return x.view(torch.int16 if x.element_size() == 2 else torch.int32)


def nearest_with_parity(y: Tensor, parity: Tensor) -> Tensor:
    """Float64 brute force: the E2M1 magnitude index of that parity nearest to |y| (ties to the smaller one)."""
    distance = (y.abs().unsqueeze(-1) - E2M1_MAGNITUDES).abs()
    wrong_parity = (torch.arange(8) & 1) != parity.unsqueeze(-1)
    return distance.masked_fill(wrong_parity, float("inf")).argmin(-1)  # argmin takes the first (smaller) tie


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("fmt", FORMATS)
def test_forward_is_torchaos_dequantized_value_in_x_dtype(sample: Tensor, fmt: str, dtype: torch.dtype,
                                                          torchao_fp4) -> None:
    x = sample.to(dtype).requires_grad_()
    out = fake_quantize(x, fmt)
    assert out.dtype == dtype and out.requires_grad
    assert torch.equal(bits(out.detach()), bits(torchao_fp4.dequantized(x.detach(), fmt, dtype)))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("mode", ["full", "parity", None])
def test_forward_with_a_record(fmt: str, mode: str | None, dtype: torch.dtype, torchao_fp4) -> None:
    """full: torchao's value of the rollout input. parity (the default): a float64 brute force over the E2M1
    grid, the value of the record's parity nearest to x under the record's scales (themselves torchao's)."""
    gen = torch.Generator().manual_seed(2)
    x_r = torch.randn(4, 64, generator=gen) * 5
    ref = parse_format(fmt).quantize(x_r)
    assert torch.equal(bits(ref.dequantize()), bits(torchao_fp4.dequantized(x_r, fmt, torch.float32)))
    x = (x_r * (1 + 0.25 * torch.randn(4, 64, generator=gen))).to(dtype)  # far enough to leave some codes
    out = fake_quantize(x, fmt, ref=ref, mode=mode)
    assert out.dtype == dtype
    if mode == "full":
        assert torch.equal(bits(out), bits(torchao_fp4.dequantized(x_r, fmt, dtype)))
        return
    multiplier = ref.block_multiplier().repeat_interleave(ref.block_size, -1)  # float32, per element
    y = x.double() / multiplier.double()
    index = nearest_with_parity(y, ref.codes().long() & 1)
    magnitude = E2M1_MAGNITUDES[index].float() * multiplier
    expected = torch.where(torch.signbit(y), -magnitude, magnitude).to(dtype)
    assert torch.equal(bits(out), bits(expected))
    assert (index != ref.codes().long() & 7).any()  # parity guidance really departs from the record somewhere


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("fmt", FORMATS)
def test_gradient_is_blocked_exactly_where_a_too_small_record_scale_clamps(fmt: str, dtype: torch.dtype) -> None:
    """Training input is twice the rollout's, so its scaled value is exactly 2 y_r under the record's scales.

    The record's own codes then tell, independently of the quantizer's arithmetic, which elements land
    inside E2M1's range (|code value| <= 2, so |2 y_r| <= 5) and which are clamped (>= 4, so |2 y_r| >= 7).
    """
    gen = torch.Generator().manual_seed(3)
    r = (torch.randn(8, 64, generator=gen) * 2).to(dtype).float()
    ref = parse_format(fmt).quantize(r)
    x = (2 * r).to(dtype).requires_grad_()
    upstream = torch.randn(8, 64, generator=gen).to(dtype)
    for mode in ("full", "parity"):
        x.grad = None
        fake_quantize(x, fmt, ref=ref, mode=mode).backward(upstream)
        rollout_value = ref.dequantize().abs() / ref.block_multiplier().repeat_interleave(ref.block_size, -1)
        inside, clamped = rollout_value <= 2.0, rollout_value >= 4.0
        assert inside.sum() > 100 and clamped.sum() > 20
        assert x.grad.dtype == dtype
        assert torch.equal(x.grad[inside], upstream[inside])
        assert torch.equal(x.grad[clamped], torch.zeros_like(upstream[clamped]))


def test_unguided_gradient_is_one_inside_and_zero_where_the_rounded_scale_clamps() -> None:
    # amax / 6 = 1.0625 rounds down to the E4M3 scale 1.0, so the block max scales to 6.375 and is clamped.
    x = torch.linspace(-5.0, 5.0, 16)
    x[4] = 6.375
    x = x.reshape(1, 16).requires_grad_()
    q = quantize(x.detach(), "nvfp4:none")
    assert q.scales.float().item() == 1.0
    fake_quantize(x, "nvfp4:none").sum().backward()
    expected = torch.ones(1, 16)
    expected[0, 4] = 0.0
    assert torch.equal(x.grad, expected)
    assert q.codes()[0, 4].item() == 7


def test_unguided_gradient_mask_in_every_format() -> None:
    """MX scales are powers of two, so |x| <= 6 * scale is the exact range test; MX FLOOR clamps up to amax < 8."""
    x = (torch.randn(16, 128, generator=torch.Generator().manual_seed(4)) * 3).requires_grad_()
    for fmt in FORMATS:
        x.grad = None
        fake_quantize(x, fmt).sum().backward()
        q = quantize(x.detach(), fmt)
        saturated = (q.codes() & 7) == 7
        assert set(x.grad.unique().tolist()) <= {0.0, 1.0}
        assert (x.grad[~saturated] == 1).all() and saturated[x.grad == 0].all()
        multiplier = q.block_multiplier().repeat_interleave(q.block_size, -1)
        if fmt.startswith("mxfp4"):
            assert torch.equal(x.grad, (x.detach().abs() <= 6 * multiplier).float())
            assert (x.grad == 0).sum() > (20 if fmt == "mxfp4" else -1)
        else:  # E4M3 rounds amax / 6 by at most 2^-4, so everything below 0.9 amax is inside
            blocks = x.detach().abs().reshape(16, -1, q.block_size)
            below = (blocks < 0.9 * blocks.amax(dim=-1, keepdim=True)).reshape(16, 128)
            assert (x.grad[below] == 1).all()
