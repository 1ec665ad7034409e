"""W4A16 linear: x @ dequant(w).T with float32 accumulation (the rollout's projections)."""

from __future__ import annotations

import torch
from torch import Tensor

from trace_lightning.quant import NVFP4
from trace_lightning.sim._weights import dequantize_weight


def fp4_linear(
    x: Tensor, w: NVFP4, out_dtype: torch.dtype | None = None, *, compute_dtype: torch.dtype = torch.float32
) -> Tensor:
    """x [M, K] (already fake-quantized by the caller, so this equals W4A4), w NVFP4 [N, K] -> [M, N].

    compute_dtype=torch.bfloat16 models a kernel that rounds the dequantized weight to bf16 before the MMA.
    """
    if x.dim() != 2 or len(w.shape) != 2 or x.shape[1] != w.shape[1]:
        raise ValueError(f"fp4_linear needs x [M, K] and w [N, K], got {tuple(x.shape)} and {w.shape}")
    wd = dequantize_weight(w)
    out = x.to(compute_dtype) @ wd.to(compute_dtype).T
    return out.to(out_dtype or x.dtype)
