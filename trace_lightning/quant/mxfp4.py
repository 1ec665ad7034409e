"""MXFP4: E2M1 elements in blocks of 32 with power-of-two E8M0 scales (OCP MX v1.0).

Reproduces torchao 0.18 `to_mx` for the FLOOR mode (scale exponent = floor(log2 amax) - 2, x divided
by the scale) and the RCEIL mode (exponent = ceil(log2(amax / 6)), x multiplied by the reciprocal),
bit for bit. A block holding NaN or +-inf gets the NaN scale byte 255, so it dequantizes to NaN
(torchao gives an infinite block a finite scale).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import Tensor

from trace_lightning.quant.blocks import BlockFP4, divide, encode_scaled, split_blocks
from trace_lightning.quant.e2m1 import E2M1_MAX, pack_fp4

MXFP4_BLOCK = 32
MX_MODES = ("floor", "rceil")
E8M0_BIAS = 127
E8M0_NAN = 255
_E2M1_MAX_POW2 = 2
_F32_MIN_NORMAL = 2.0**-126


def check_mx_mode(mode: str) -> str:
    if mode not in MX_MODES:
        raise ValueError(f"unknown MXFP4 scale mode {mode!r}; expected one of {MX_MODES}")
    return mode


@dataclass
class MXFP4(BlockFP4):
    """An MXFP4 tensor: `packed` uint8 [..., K/2], `scales` float8_e8m0fnu [..., K/32], scale `mode`."""

    mode: str = "floor"
    block_size: ClassVar[int] = MXFP4_BLOCK

    def _biased(self) -> Tensor:
        return self.scales.view(torch.uint8).to(torch.int32)

    def block_multiplier(self) -> Tensor:
        biased = self._biased()
        scale = torch.exp2((biased - E8M0_BIAS).float())
        return scale.masked_fill(biased == E8M0_NAN, float("nan"))

    def scale_input(self, blocks: Tensor) -> Tensor:
        biased = self._biased()
        if self.mode == "floor":
            scale = torch.bitwise_left_shift(biased, 23).view(torch.float32)
            return blocks / torch.clamp(scale, min=_F32_MIN_NORMAL).unsqueeze(-1)
        rcp = torch.where(biased == 0, 1.0, torch.exp2(E8M0_BIAS - biased.float()))
        rcp = torch.where(biased == E8M0_NAN - 1, 2.0**-127, rcp)
        rcp = rcp.masked_fill(biased == E8M0_NAN, float("nan"))
        return blocks * rcp.unsqueeze(-1)

    def with_codes(self, codes: Tensor) -> MXFP4:
        return MXFP4(packed=pack_fp4(codes), scales=self.scales, mode=self.mode)


def mx_scale_bytes(blocks: Tensor, mode: str) -> Tensor:
    """Biased E8M0 exponents (uint8) [..., nb] for float32 blocks [..., nb, 32]."""
    amax = blocks.abs().amax(dim=-1)
    if mode == "floor":
        exponent = (torch.bitwise_right_shift(amax.view(torch.int32), 23) & 0xFF) - E8M0_BIAS - _E2M1_MAX_POW2
        biased = (torch.clamp(exponent, min=-E8M0_BIAS, max=E8M0_BIAS + 1) + E8M0_BIAS).to(torch.uint8)
    else:
        exponent = torch.clamp(torch.ceil(torch.log2(divide(amax, E2M1_MAX))), min=-E8M0_BIAS, max=E8M0_BIAS)
        biased = (exponent + E8M0_BIAS).to(torch.uint8)
    return biased.masked_fill(~torch.isfinite(amax), E8M0_NAN)


def quantize_mxfp4(x: Tensor, mode: str = "floor") -> MXFP4:
    """Quantize x [..., K] (K % 32 == 0) to MXFP4 with the FLOOR or RCEIL scale rule."""
    check_mx_mode(mode)
    blocks = split_blocks(x, MXFP4_BLOCK)
    scales = mx_scale_bytes(blocks, mode).view(torch.float8_e8m0fnu)
    out = MXFP4(packed=torch.empty(0, dtype=torch.uint8), scales=scales, mode=mode)
    out.packed = encode_scaled(out.scale_input(blocks))
    return out
