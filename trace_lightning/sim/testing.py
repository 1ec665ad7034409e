"""Random FP4 problems for tests and benchmarks (weights quantized as the rollout converter does)."""

from __future__ import annotations

import torch
from torch import Tensor

from trace_lightning.quant import NVFP4, quantize_nvfp4, tensor_global_scale


def quantize_weight(w: Tensor) -> NVFP4:
    """NVFP4 weight with one global scale per matrix (per expert for stacked [E, N, K])."""
    g = tensor_global_scale(w, dims=2)
    return quantize_nvfp4(w, g.reshape(*g.shape, *([1] * (w.dim() - g.dim()))) if w.dim() == 3 else g)


def expert_slice(w: NVFP4, e: int) -> NVFP4:
    return NVFP4(w.packed[e], w.scales[e], w.global_scale[e])


def random_routing(n: int, k: int, experts: int, gen: torch.Generator) -> tuple[Tensor, Tensor]:
    """Distinct top-k expert ids per token and positive weights."""
    ids = torch.stack([torch.randperm(experts, generator=gen)[:k] for _ in range(n)])
    return ids, torch.rand(n, k, generator=gen) + 0.1
