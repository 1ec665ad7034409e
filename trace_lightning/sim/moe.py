"""Routed SwiGLU experts on NVFP4 weights, with the `moe_down` activation quantized per pair row.

Pairs (token, slot) keep the canonical token-major order of the model's hook site `moe_down`; only the
experts some token picked are dequantized and computed, like the kernel's expert-sorted tiles.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from trace_lightning.quant import NVFP4
from trace_lightning.sim._weights import dequantize_weight
from trace_lightning.sim.quantize import quantize_nvfp4_rows


def check_moe_args(x: Tensor, w13: NVFP4, w2: NVFP4, topk_ids: Tensor, topk_weights: Tensor) -> tuple[int, int, int]:
    """Validate shapes; return (E, I, k)."""
    E, two_i, D = w13.shape
    I = two_i // 2
    if x.dim() != 2 or x.shape[1] != D or tuple(w2.shape) != (E, D, I) or two_i % 2:
        raise ValueError(f"fp4_moe shapes: x {tuple(x.shape)}, w13 {w13.shape}, w2 {w2.shape}")
    if topk_ids.shape != topk_weights.shape or topk_ids.dim() != 2 or topk_ids.shape[0] != x.shape[0]:
        raise ValueError(f"topk_ids {tuple(topk_ids.shape)} / topk_weights {tuple(topk_weights.shape)} must be [N, k]")
    return E, I, topk_ids.shape[1]


def fp4_moe(
    x: Tensor, w13: NVFP4, w2: NVFP4, topk_ids: Tensor, topk_weights: Tensor, quantize_intermediate: bool = True,
    *, compute_dtype: torch.dtype = torch.float32,
) -> tuple[Tensor, NVFP4 | None]:
    """x [N, D], w13 [E, 2I, D] (gate rows then up rows), w2 [E, D, I] -> (out [N, D], moe_down NVFP4 [N, k, I]).

    compute_dtype=torch.bfloat16 rounds the gate/up outputs and h to bf16, as a bf16 model forward does.
    """
    E, I, k = check_moe_args(x, w13, w2, topk_ids, topk_weights)
    N = x.shape[0]
    flat = topk_ids.reshape(-1)  # (N*k,) canonical pair order
    experts = torch.unique(flat)
    h = torch.zeros(N * k, I, dtype=torch.float32, device=x.device)
    w13d = dequantize_weight(w13, experts)  # (E_touched, 2I, D)
    for i, e in enumerate(experts.tolist()):
        pairs = (flat == e).nonzero().squeeze(1)
        gu = (x[pairs // k].to(compute_dtype) @ w13d[i].to(compute_dtype).T).float()  # (n_e, 2I)
        gate, up = gu.to(compute_dtype).chunk(2, dim=-1)
        h[pairs] = (F.silu(gate) * up).float()
    q = quantize_nvfp4_rows(h.view(N, k, I)) if quantize_intermediate else None
    hd = q.dequantize().view(N * k, I) if q is not None else h
    y = torch.zeros(N * k, x.shape[1], dtype=torch.float32, device=x.device)
    w2d = dequantize_weight(w2, experts)  # (E_touched, D, I)
    for i, e in enumerate(experts.tolist()):
        pairs = (flat == e).nonzero().squeeze(1)
        y[pairs] = (hd[pairs].to(compute_dtype) @ w2d[i].to(compute_dtype).T).float()
    out = (y.view(N, k, -1) * topk_weights.float().unsqueeze(-1)).sum(dim=1)
    return out.to(x.dtype), q
