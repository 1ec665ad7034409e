"""Guided rounding: the training side rounds to the codes the rollout produced (DESIGN.md section 5).

Training never recomputes scales for a recorded site: it maps its own x into E2M1 units with the
rollout's scales, in the quantizer's operation order, then either takes the recorded codes
(`full`) or, knowing only each code's mantissa (parity) bit, picks the nearest E2M1 magnitude with
that parity (`parity`, ties to the smaller magnitude). Same-parity magnitudes are two grid steps
apart, so parity guidance recovers the rollout's code whenever the two sides' scaled values differ
by less than half a grid step (at least 0.25 in E2M1 units).
"""

from __future__ import annotations

import torch
from torch import Tensor

from trace_lightning.quant.blocks import BlockFP4, split_blocks

GUIDANCE_MODES = ("full", "parity")

# Decision thresholds on |y| between consecutive same-parity magnitudes (ties go to the smaller one).
_EVEN_THRESHOLDS = (0.5, 1.5, 3.0)  # magnitudes 0, 1, 2, 4 (codes 0, 2, 4, 6)
_ODD_THRESHOLDS = (1.0, 2.25, 4.5)  # magnitudes 0.5, 1.5, 3, 6 (codes 1, 3, 5, 7)


def check_guidance_mode(mode: str) -> str:
    if mode not in GUIDANCE_MODES:
        raise ValueError(f"unknown guidance mode {mode!r}; expected one of {GUIDANCE_MODES}")
    return mode


def parity_round(y: Tensor, parity: Tensor) -> Tensor:
    """E2M1 codes for scaled values y whose magnitude index must have the given parity bit (0/1)."""
    mag = y.abs()
    even = sum((mag > t).to(torch.uint8) for t in _EVEN_THRESHOLDS) * 2
    odd = sum((mag > t).to(torch.uint8) for t in _ODD_THRESHOLDS) * 2 + 1
    index = torch.where(parity.bool(), odd, even).to(torch.uint8)
    return index | (torch.signbit(y).to(torch.uint8) << 3)


def mark_nonfinite_blocks(out: BlockFP4, blocks: Tensor) -> BlockFP4:
    """Give blocks whose training-side input is non-finite the NaN scale, never a finite value."""
    bad = ~torch.isfinite(blocks).all(dim=-1)
    nan_byte = 0x7F if out.scales.dtype == torch.float8_e4m3fn else 0xFF  # unconditionally: no host sync a site
    out.scales = out.scales.view(torch.uint8).masked_fill(bad, nan_byte).view(out.scales.dtype)
    return out


def guided_quantize(x: Tensor, ref: BlockFP4, mode: str) -> BlockFP4:
    """Quantize x with the rollout's scales `ref`, to its codes (full) or to codes of its parity."""
    check_guidance_mode(mode)
    if tuple(x.shape) != tuple(ref.shape):
        raise ValueError(f"input shape {tuple(x.shape)} does not match the record's shape {tuple(ref.shape)}")
    blocks = split_blocks(x, ref.block_size)
    ref_codes = ref.codes()
    if mode == "full":
        codes = ref_codes
    else:
        y = ref.scale_input(blocks).reshape(x.shape)
        codes = parity_round(y, ref_codes & 1)
    return mark_nonfinite_blocks(ref.with_codes(codes), blocks)
