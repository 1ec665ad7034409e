"""Deterministic sums of float32 partials (MoE slots, split-K slices) fused with the cast to the output dtype."""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from trace_lightning.kernels._common import grid_dependency
from trace_lightning.kernels._fp4 import await_previous_grid


@triton.jit
def _sum_kernel(y_ptr, out_ptr, D, stride_row, stride_part, PARTS: tl.constexpr, BLOCK_D: tl.constexpr,
                PDL: tl.constexpr = False):
    await_previous_grid(PDL)
    row = tl.program_id(0).to(tl.int64)
    d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    acc = tl.zeros((BLOCK_D,), tl.float32)
    for j in range(PARTS):  # fixed order: bit-reproducible
        acc += tl.load(y_ptr + row * stride_row + j * stride_part + d, mask=d < D, other=0.0)
    tl.store(out_ptr + row * D + d, acc.to(out_ptr.dtype.element_ty), mask=d < D)


def sum_partials(y: Tensor, dim: int, dtype: torch.dtype) -> Tensor:
    """Sum a contiguous float32 [A, B, D] over dim 0 or 1 into [rows, D] of dtype, in one launch."""
    if y.dim() != 3 or dim not in (0, 1) or not y.is_contiguous():
        raise ValueError(f"sum_partials needs a contiguous [A, B, D] tensor, dim 0 or 1; got {tuple(y.shape)}, {dim}")
    A, B, D = y.shape
    rows, parts = (B, A) if dim == 0 else (A, B)
    stride_row, stride_part = (D, B * D) if dim == 0 else (B * D, D)
    out = torch.empty(rows, D, dtype=dtype, device=y.device)
    block_d = min(1024, triton.next_power_of_2(D))
    _sum_kernel[(rows, triton.cdiv(D, block_d))](y, out, D, stride_row, stride_part, parts, block_d, num_warps=4,
                                                 **grid_dependency(y.device))
    return out
