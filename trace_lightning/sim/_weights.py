"""Weight-side helpers shared by the sim GEMMs: per-row global scales and dequantization."""

from __future__ import annotations

import torch
from torch import Tensor

from trace_lightning.quant import NVFP4, BlockFP4, FP4Format, decode_e2m1, quantize_weight, unpack_fp4
from trace_lightning.quant.words import canonical


def global_strides(w: NVFP4) -> tuple[Tensor, tuple[int, ...]]:
    """(float32 global scales, one stride per leading dim of the weight): row (i_0, .., i_n)'s global is
    g[sum(i_d * stride_d)], whatever shape it was stored in. Kernels read it by stride (no per-call expand);
    row_globals expands it.

    Accepts None, a scalar, one value per leading matrix ([E], [E, 1], [E, 1, 1]) or one per row ([..., N, 1]).
    """
    lead = tuple(w.packed.shape[:-1])
    g = w.global_scale
    if g is None:
        return torch.ones(1, dtype=torch.float32, device=w.packed.device), (0,) * len(lead)
    g = g.to(device=w.packed.device, dtype=torch.float32).contiguous().reshape(-1)
    if g.numel() == 1:
        return g, (0,) * len(lead)
    if len(lead) >= 2 and g.numel() == lead[0]:
        return g, (1,) + (0,) * (len(lead) - 1)
    if g.numel() == torch.Size(lead).numel():
        return g, g.view(lead).stride()
    raise ValueError(f"weight global scale of shape {tuple(w.global_scale.shape)} does not fit weight rows {lead}")


def row_globals(w: NVFP4) -> Tensor:
    """The weight's global scale as float32 [..., N] (one per output row), whatever shape it was stored in."""
    g, strides = global_strides(w)
    return g.as_strided(tuple(w.packed.shape[:-1]), strides).contiguous()


def dequantize_weight(w: NVFP4, rows: Tensor | None = None) -> Tensor:
    """float32 dequantized weight [..., N, K] (only the leading indices `rows`, if given): code * (scale * g).
    A weight in the Triton kernels' word layout is read in stored order (exact), never misread."""
    w = canonical(w)
    packed, scales, g = w.packed, w.scales, row_globals(w)
    if rows is not None:
        packed, scales, g = packed[rows], scales[rows], g[rows]
    values = decode_e2m1(unpack_fp4(packed), checked=False).unflatten(-1, (-1, 16))
    return (values * (scales.float() * g.unsqueeze(-1)).unsqueeze(-1)).flatten(-2)


def prepare_weight(q: NVFP4, compute_dtype: torch.dtype) -> NVFP4:
    """The sim reads weights in stored order: q unchanged (the kernels' twin may permute bits for its decoder)."""
    return q


def prepared_weight(w: Tensor, fmt: FP4Format | str, compute_dtype: torch.dtype) -> BlockFP4:
    """prepare_weight(quantize_weight(w, fmt)): the one weight quantizer's result, in stored order."""
    return quantize_weight(w, fmt)


def prefers_word_layout(dtype: torch.dtype, device: torch.device | str, cache: bool = False) -> bool:
    """The sim decodes codes from the stored order: no FP4 tensor is worth permuting for it."""
    return False


def prefers_value_tiles(dtype: torch.dtype, device: torch.device | str) -> bool:
    """The sim reads the KV cache's values in stored order (it writes and reads value tiles too, slowly)."""
    return False
