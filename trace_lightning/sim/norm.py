"""RMSNorm as the model computes it (the reference for trace_lightning.kernels.rms_norm)."""

from __future__ import annotations

import torch
from torch import Tensor


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """weight * rmsnorm(x) over the last dim: float32 statistics, cast to x's dtype, then the weight product."""
    xf = x.float()
    return weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
