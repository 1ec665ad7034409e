"""The MoE router after its GEMV, as the model computes it (the reference for trace_lightning.kernels.route_topk)."""

from __future__ import annotations

import torch
from torch import Tensor

from trace_lightning.model.model import top_k_gates

SCORINGS = ("softmax", "sigmoid")
FLOATS = (torch.bfloat16, torch.float16, torch.float32)


def check_route_args(logits: Tensor, top_k: int, scoring: str, out_dtype: torch.dtype) -> None:
    """Clear errors for arguments neither router op can take (shared with trace_lightning.kernels.route_topk)."""
    E = logits.shape[-1]
    if scoring not in SCORINGS:
        raise ValueError(f"scoring must be one of {SCORINGS}, got {scoring!r}")
    if not 1 <= top_k <= E:
        raise ValueError(f"top_k must be in 1..{E} (the number of experts), got {top_k}")
    if logits.dtype not in FLOATS or out_dtype not in FLOATS:
        raise ValueError(f"route_topk needs float logits and a float out_dtype (bfloat16, float16 or float32), got "
                         f"{logits.dtype} and {out_dtype}")


def route_topk(logits: Tensor, top_k: int, scoring: str, normalize: bool,
               out_dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """logits [..., E] -> (gates [..., top_k] in out_dtype, ids [..., top_k] int64), best first: the model's
    Router without replay (float32 scores, torch.topk, optionally gates / their sum)."""
    check_route_args(logits, top_k, scoring, out_dtype)
    return top_k_gates(logits, top_k, scoring, normalize, out_dtype)
