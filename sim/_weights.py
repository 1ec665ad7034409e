"""Weight-side helpers shared by the sim GEMMs: per-row global scales and dequantization."""

from __future__ import annotations

import torch
from torch import Tensor

from trace_lightning.quant import NVFP4, decode_e2m1, unpack_fp4


def row_globals(w: NVFP4) -> Tensor:
    """The weight's global scale as float32 [..., N] (one per output row), whatever shape it was stored in.

    Accepts None, a scalar, one value per leading matrix ([E], [E, 1], [E, 1, 1]) or one per row ([..., N, 1]).
    """
    lead = tuple(w.packed.shape[:-1])
    g = w.global_scale
    if g is None:
        return torch.ones(lead, dtype=torch.float32, device=w.packed.device)
    g = g.to(device=w.packed.device, dtype=torch.float32)
    if g.numel() == 1:
        return g.reshape(()).expand(lead).contiguous()
    if len(lead) >= 2 and g.numel() == lead[0]:
        return g.reshape(lead[0], *([1] * (len(lead) - 1))).expand(lead).contiguous()
    if g.numel() == torch.Size(lead).numel():
        return g.reshape(lead).contiguous()
    raise ValueError(f"weight global scale of shape {tuple(g.shape)} does not fit weight rows {lead}")


def dequantize_weight(w: NVFP4, rows: Tensor | None = None) -> Tensor:
    """float32 dequantized weight [..., N, K] (only the leading indices `rows`, if given): code * (scale * g)."""
    packed, scales, g = w.packed, w.scales, row_globals(w)
    if rows is not None:
        packed, scales, g = packed[rows], scales[rows], g[rows]
    values = decode_e2m1(unpack_fp4(packed)).unflatten(-1, (-1, 16))
    return (values * (scales.float() * g.unsqueeze(-1)).unsqueeze(-1)).flatten(-2)
