"""Head RMSNorm then rotate-half RoPE, as the model computes it (the reference for trace_lightning.kernels.rope)."""

from __future__ import annotations

from torch import Tensor

from trace_lightning.model.model import apply_rope
from trace_lightning.sim.norm import rms_norm


def rope(x: Tensor, cos: Tensor, sin: Tensor, norm_weight: Tensor | None = None, eps: float = 0.0) -> Tensor:
    """x (B, T, H, Dh), cos / sin (B, T, Dh) -> apply_rope(rms_norm(x, norm_weight) or x, cos, sin)."""
    return apply_rope(x if norm_weight is None else rms_norm(x, norm_weight, eps), cos, sin)
