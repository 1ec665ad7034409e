"""Guided rounding (DESIGN.md section 5): full mode reproduces the record, parity mode recovers its codes.

The parity guarantee, made precise: the rollout's code c has signed value G[i] on the signed grid
G = (-6, -4, -3, -2, -1.5, -1, -0.5, 0, 0.5, 1, 1.5, 2, 3, 4, 6), and its scaled value y_r lies in
c's round-to-nearest-even interval. Parity guidance picks between G[i] and its same-parity
neighbours G[i -+ 2], so training recovers c whenever y moves from y_r by less than
(G[i-1] - G[i-2]) / 2 downwards or (G[i+2] - G[i+1]) / 2 upwards (unbounded past the grid's ends):
half the step on the far side of c's neighbour, which is always at least 0.25. The bound is tight
(see test_parity_margin_is_tight); half the step adjacent to c itself would not be enough for c = +-3.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import Tensor

from trace_lightning.quant import BlockFP4, decode_e2m1, fake_quantize, guided_quantize, parity_round, parse_format

FORMATS = ("nvfp4", "nvfp4:none", "nvfp4:matrix", "mxfp4", "mxfp4:rceil")
GRID = (-6.0, -4.0, -3.0, -2.0, -1.5, -1.0, -0.5, 0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
UNBOUNDED = 4.0  # past the grid's ends parity never changes; cap the perturbation there


def grid_margins() -> tuple[Tensor, Tensor]:
    """(down, up) guaranteed margins per code 0..15, in E2M1 units."""
    down, up = torch.empty(16), torch.empty(16)
    for code in range(16):
        value = float(decode_e2m1(torch.tensor([code], dtype=torch.uint8)))
        i = GRID.index(value)
        down[code] = (GRID[i - 1] - GRID[i - 2]) / 2 if i >= 2 else UNBOUNDED
        up[code] = (GRID[i + 2] - GRID[i + 1]) / 2 if i + 2 < len(GRID) else UNBOUNDED
    return down, up


DOWN, UP = grid_margins()


def rollout_input(seed: int, rows: int, blocks: int, block: int, log10_scale: float, kind: str) -> Tensor:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, blocks * block, generator=gen)
    if kind == "heavy":
        x = x / torch.rand(rows, blocks * block, generator=gen).clamp(min=0.05)
    elif kind == "zeros":
        x[:, :block] = 0.0
    return x * 10.0**log10_scale


def block_scaled(q: BlockFP4, x: Tensor) -> Tensor:
    return q.scale_input(x.reshape(*x.shape[:-1], -1, q.block_size)).reshape(x.shape)


def zero_sign_agnostic(codes: Tensor) -> Tensor:
    return torch.where(codes == 8, torch.zeros_like(codes), codes)


inputs = st.fixed_dictionaries(
    {
        "fmt": st.sampled_from(FORMATS),
        "seed": st.integers(0, 2**31 - 1),
        "rows": st.integers(1, 4),
        "blocks": st.integers(1, 4),
        "log10_scale": st.floats(-6.0, 6.0),
        "kind": st.sampled_from(["normal", "heavy", "zeros"]),
    }
)


@settings(max_examples=60, deadline=None)
@given(case=inputs, perturb_seed=st.integers(0, 2**31 - 1))
def test_parity_recovers_rollout_codes_within_the_margin(case: dict, perturb_seed: int) -> None:
    fmt = parse_format(case.pop("fmt"))
    x_r = rollout_input(block=fmt.block_size, **case)
    ref = fmt.quantize(x_r)
    codes = ref.codes()
    y_r = block_scaled(ref, x_r)
    gen = torch.Generator().manual_seed(perturb_seed)
    downwards = torch.rand(y_r.shape, generator=gen) < 0.5
    margin = torch.where(downwards, -DOWN[codes.long()], UP[codes.long()])
    y = y_r + 0.95 * torch.rand(y_r.shape, generator=gen) * margin
    multiplier = block_scaled(ref, torch.ones_like(x_r))  # E2M1 units per unit of x, per block
    x = y / multiplier
    assert torch.isfinite(x).all()
    guided = guided_quantize(x, ref, "parity")
    assert torch.equal(zero_sign_agnostic(guided.codes()), zero_sign_agnostic(codes))
    assert torch.equal(guided.scale_bytes(), ref.scale_bytes())
    assert torch.equal(fake_quantize(x, fmt, ref=ref, mode="parity").abs(), ref.dequantize().abs())


@settings(max_examples=40, deadline=None)
@given(case=inputs, other_seed=st.integers(0, 2**31 - 1), other_log10_scale=st.floats(-8.0, 8.0))
def test_full_mode_reproduces_the_record_for_any_input(case: dict, other_seed: int, other_log10_scale: float) -> None:
    fmt = parse_format(case.pop("fmt"))
    ref = fmt.quantize(rollout_input(block=fmt.block_size, **case))
    x = torch.randn(ref.shape, generator=torch.Generator().manual_seed(other_seed)) * 10.0**other_log10_scale
    guided = guided_quantize(x, ref, "full")
    assert type(guided) is type(ref)
    assert torch.equal(guided.packed, ref.packed) and torch.equal(guided.scale_bytes(), ref.scale_bytes())
    assert torch.equal(guided.dequantize(), ref.dequantize())
    assert torch.equal(fake_quantize(x.bfloat16(), fmt, ref=ref, mode="full"), ref.dequantize(torch.bfloat16))


@settings(max_examples=40, deadline=None)
@given(case=inputs)
def test_parity_mode_on_the_rollout_input_reproduces_its_codes_exactly(case: dict) -> None:
    fmt = parse_format(case.pop("fmt"))
    x_r = rollout_input(block=fmt.block_size, **case)
    ref = fmt.quantize(x_r)
    guided = guided_quantize(x_r, ref, "parity")
    assert torch.equal(guided.packed, ref.packed) and torch.equal(guided.scale_bytes(), ref.scale_bytes())


def brute_force_parity_round(y: Tensor, parity: Tensor) -> Tensor:
    """argmin over magnitudes of the given parity of | |y| - E2M1[m] |, ties to the smaller m; sign of y."""
    magnitudes = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], dtype=torch.float64)
    # Exact in float64 for float32 y; past 6 the nearest is the largest magnitude, so clamp to keep it exact.
    distance = (y.abs().double().clamp(max=7.0)[..., None] - magnitudes).abs()
    wrong_parity = (torch.arange(8) & 1) != parity.long()[..., None]
    distance = distance.masked_fill(wrong_parity, float("inf"))
    index = distance.argmin(dim=-1).to(torch.uint8)  # argmin returns the first (smaller) index on ties
    return index | (torch.signbit(y).to(torch.uint8) << 3)


def test_parity_round_equals_brute_force_on_a_dense_sweep() -> None:
    thresholds = torch.tensor([0.5, 1.0, 1.5, 2.25, 3.0, 4.5])
    near = (thresholds.view(torch.int32)[:, None] + torch.arange(-64, 65, dtype=torch.int32)).view(torch.float32)
    y = torch.cat((torch.linspace(-8.0, 8.0, 200_001), near.flatten(), torch.tensor([0.0, -0.0, 1e30, -1e30])))
    for parity in (0, 1):
        p = torch.full(y.shape, parity, dtype=torch.uint8)
        assert torch.equal(parity_round(y, p), brute_force_parity_round(y, p))


def test_parity_round_ties_go_to_the_smaller_magnitude() -> None:
    y = torch.tensor([0.5, 1.5, 3.0, 1.0, 2.25, 4.5])
    parity = torch.tensor([0, 0, 0, 1, 1, 1], dtype=torch.uint8)
    assert parity_round(y, parity).tolist() == [0, 2, 4, 1, 3, 5]
    assert parity_round(-y, parity).tolist() == [8, 10, 12, 9, 11, 13]


@pytest.mark.parametrize("code", range(16))
def test_parity_margin_is_tight(code: int) -> None:
    """At the edge of c's rounding interval, moving by just over the margin lands on another code."""
    value = decode_e2m1(torch.tensor([code], dtype=torch.uint8)).item()
    i = GRID.index(value)
    edges = [
        ((GRID[i - 1] + GRID[i]) / 2, -DOWN[code].item(), i >= 2),
        ((GRID[i] + GRID[i + 1]) / 2 if i + 1 < len(GRID) else None, UP[code].item(), i + 2 < len(GRID)),
    ]
    for edge, margin, bounded in edges:
        if edge is None or not bounded:
            continue
        inside = torch.nextafter(torch.tensor(edge), torch.tensor(value))  # y_r just inside c's interval
        parity = torch.tensor([code & 1], dtype=torch.uint8)
        within = inside + 0.999 * torch.tensor(margin)
        beyond = inside + 1.001 * torch.tensor(margin)
        expected = zero_sign_agnostic(torch.tensor([code], dtype=torch.uint8))
        assert torch.equal(zero_sign_agnostic(parity_round(within.reshape(1), parity)), expected)
        assert not torch.equal(zero_sign_agnostic(parity_round(beyond.reshape(1), parity)), expected)


def test_half_the_adjacent_step_is_not_enough_for_three() -> None:
    y_r = torch.tensor([2.51])  # rounds to 3 (code 5); the step below 3 is 1, but the margin is only 0.25
    code = parity_round(y_r, torch.tensor([1], dtype=torch.uint8))
    assert code.item() == 5
    assert parity_round(y_r - 0.4, torch.tensor([1], dtype=torch.uint8)).item() == 3
    assert DOWN[5].item() == 0.25 and min(itertools.chain(DOWN.tolist(), UP.tolist())) == 0.25
