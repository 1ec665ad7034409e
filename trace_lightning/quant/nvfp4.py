"""NVFP4: E2M1 elements in blocks of 16 with E4M3 block scales and an optional float32 global scale.

The arithmetic reproduces torchao 0.18 `nvfp4_quantize` operation for operation (block amax / 6,
divide by the global scale, clamp to [2^-6, 448], cast to E4M3, multiply x by (1/global)/scale,
clamp to +-6, round to nearest even), so codes and scale bytes are identical to it.

Two deliberate differences, both for inputs torchao does not define well:
- a block holding NaN or +-inf gets the NaN scale byte, so it dequantizes to NaN instead of
  silently becoming finite codes;
- global scales are floored at 2^-120, so an all-zero row (padding) quantizes to zeros instead of NaN.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import Tensor

from trace_lightning.quant.blocks import BlockFP4, divide, encode_scaled, split_blocks
from trace_lightning.quant.e2m1 import E2M1_MAX, check_float_input, pack_fp4

NVFP4_BLOCK = 16
E4M3_MAX = 448.0
E4M3_TINY = 2.0**-6  # torch.finfo(torch.float8_e4m3fn).tiny
E4M3_NAN_BYTE = 0x7F
GLOBAL_SCALE_FLOOR = 2.0**-120


@dataclass
class NVFP4(BlockFP4):
    """An NVFP4 tensor: `packed` uint8 [..., K/2], `scales` float8_e4m3fn [..., K/16], `global_scale`."""

    global_scale: Tensor | None = None
    block_size: ClassVar[int] = NVFP4_BLOCK

    def block_multiplier(self) -> Tensor:
        s = self.scales.float()
        return s if self.global_scale is None else s * self.global_scale

    def scale_input(self, blocks: Tensor) -> Tensor:
        s = self.scales.float()
        reciprocal = 1.0 / s if self.global_scale is None else (1.0 / self.global_scale) / s
        return blocks * reciprocal.unsqueeze(-1)

    def with_codes(self, codes: Tensor) -> NVFP4:
        return NVFP4(packed=pack_fp4(codes), scales=self.scales, global_scale=self.global_scale)


def _check_global_scale(global_scale: Tensor | None, x: Tensor) -> Tensor | None:
    if global_scale is None:
        return None
    if not isinstance(global_scale, Tensor):
        global_scale = torch.tensor(float(global_scale))
    g = global_scale.to(device=x.device, dtype=torch.float32)
    if g.dim() and g.shape[-1] != 1:
        raise ValueError(f"global_scale must be a scalar or have a trailing dim of 1, got shape {tuple(g.shape)}")
    rows = x.shape[:-1] + (1,)
    try:
        fits = torch.broadcast_shapes(g.shape, rows) == rows  # must not add rows that x does not have
    except RuntimeError:
        fits = False
    if not fits:
        raise ValueError(
            f"global_scale of shape {tuple(g.shape)} does not broadcast to input of shape {tuple(x.shape)}"
        )
    return g


def row_global_scale(x: Tensor) -> Tensor:
    """Per-row global scale amax_row / (448 * 6), shape [..., 1]: a row never depends on its batch."""
    check_float_input(x)
    amax = x.float().abs().amax(dim=-1, keepdim=True)
    return torch.clamp(divide(amax, E4M3_MAX * E2M1_MAX), min=GLOBAL_SCALE_FLOOR)


def tensor_global_scale(w: Tensor, dims: int = 2) -> Tensor:
    """Per-matrix global scale over the last `dims` dims (per expert for stacked [E, out, in] weights)."""
    check_float_input(w)
    amax = w.float().abs().amax(dim=tuple(range(-dims, 0)), keepdim=True)
    scale = torch.clamp(divide(amax, E4M3_MAX * E2M1_MAX), min=GLOBAL_SCALE_FLOOR)
    return scale.reshape(scale.shape[:-1]) if dims > 1 else scale


def nvfp4_scales(blocks: Tensor, global_scale: Tensor | None) -> Tensor:
    """E4M3 block scales [..., nb] for float32 blocks [..., nb, 16], NaN where a block is non-finite."""
    amax = blocks.abs().amax(dim=-1)
    block_scale = divide(amax, E2M1_MAX)
    if global_scale is not None:
        block_scale = block_scale / global_scale
    scales = torch.clamp(block_scale, min=E4M3_TINY, max=E4M3_MAX).to(torch.float8_e4m3fn)
    bad = ~torch.isfinite(amax)
    if global_scale is not None:
        bad = bad | ~torch.isfinite(global_scale)
    # unconditionally: asking whether any block is bad would sync with the host on every (weight) quantization
    return scales.view(torch.uint8).masked_fill(bad, E4M3_NAN_BYTE).view(torch.float8_e4m3fn)


def quantize_nvfp4(x: Tensor, global_scale: Tensor | float | None = None) -> NVFP4:
    """Quantize x [..., K] (K % 16 == 0) to NVFP4; global_scale is None, a scalar, or [..., 1]."""
    blocks = split_blocks(x, NVFP4_BLOCK)
    g = _check_global_scale(global_scale, x)
    out = NVFP4(packed=torch.empty(0, dtype=torch.uint8), scales=nvfp4_scales(blocks, g), global_scale=g)
    out.packed = encode_scaled(out.scale_input(blocks))
    return out
