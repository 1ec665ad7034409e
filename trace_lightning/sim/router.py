"""The MoE router after its GEMV, as the model computes it (the reference for trace_lightning.kernels.route_topk)."""

from __future__ import annotations

import torch
from torch import Tensor

SCORINGS = ("softmax", "sigmoid")


def route_topk(logits: Tensor, top_k: int, scoring: str, normalize: bool,
               out_dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """logits [..., E] -> (gates [..., top_k] in out_dtype, ids [..., top_k] int64), best first: float32 scores,
    torch.topk, optionally gates / their sum (Router.forward without replay)."""
    E = logits.shape[-1]
    if scoring not in SCORINGS:
        raise ValueError(f"scoring must be one of {SCORINGS}, got {scoring!r}")
    if not 1 <= top_k <= E:
        raise ValueError(f"top_k must be in 1..{E} (the number of experts), got {top_k}")
    if not logits.dtype.is_floating_point or not out_dtype.is_floating_point:
        raise ValueError(f"route_topk needs float logits and a float out_dtype, got {logits.dtype} and {out_dtype}")
    logits = logits.float()
    scores = logits.softmax(dim=-1) if scoring == "softmax" else logits.sigmoid()
    gates, ids = scores.topk(top_k, dim=-1)
    if normalize:
        gates = gates / gates.sum(dim=-1, keepdim=True)
    return gates.to(out_dtype), ids
