"""RMSNorm in one launch: the rollout's norms were ~6 torch kernels each (cast, square, mean, rsqrt, scale,
cast back, weight), about 60 us per layer of the FP4 decode step at batch 64 (tools/profile_engine.py).

Same arithmetic as the model's RMSNorm (the Hugging Face order): float32 mean of squares, rsqrt, scale, cast
to the input dtype, then the weight product rounded once to the result dtype. Only the float32 sum order
(and its 1 / D multiply) can differ from torch's, so bf16 results agree bit for bit except where a last-bit
difference of the mean crosses a rounding boundary (none in the CPU tests; >= 99% equal asserted on CUDA).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from trace_lightning.kernels._common import TL_DTYPES, grid_dependency
from trace_lightning.kernels._fp4 import await_previous_grid


@triton.jit
def _round_to(x, DTYPE: tl.constexpr):
    """float32 x rounded to DTYPE to nearest even, also under the CPU interpreter (whose bf16 cast truncates)."""
    if DTYPE == tl.bfloat16:
        b = x.to(tl.int32, bitcast=True)
        r = ((b + 0x7FFF + ((b >> 16) & 1)) >> 16).to(tl.int16).to(tl.bfloat16, bitcast=True)
        return tl.where(x != x, x.to(tl.bfloat16), r)  # NaN: any NaN (the bit trick could carry out of it)
    else:
        return x.to(DTYPE)


@triton.jit
def _rms_norm_kernel(x_ptr, w_ptr, out_ptr, R, D, inv_d, eps, X_DTYPE: tl.constexpr, ROWS: tl.constexpr,
                     BLOCK_D: tl.constexpr, PDL: tl.constexpr = False):
    await_previous_grid(PDL)
    r = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    d = tl.arange(0, BLOCK_D)
    mask = (r[:, None] < R) & (d[None, :] < D)
    offs = r[:, None].to(tl.int64) * D + d[None, :]
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    inv = tl.math.rsqrt(tl.sum(x * x, axis=1) * inv_d + eps)
    w = tl.load(w_ptr + d, mask=d < D, other=0.0).to(tl.float32)
    tl.store(out_ptr + offs, weighted_norm(x, inv, w[None, :], X_DTYPE, out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def weighted_norm(x, inv, w, X_DTYPE: tl.constexpr, OUT_DTYPE: tl.constexpr):
    """weight * (x * inv).to(x's dtype), rounded to OUT_DTYPE: the model's RMSNorm after its statistics
    (float32 x [rows, cols], inv [rows], w broadcastable to x)."""
    return _round_to(w * _round_to(x * inv[:, None], X_DTYPE).to(tl.float32), OUT_DTYPE)


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """weight * rmsnorm(x) over the last dim, in promote(weight, x) dtype (Triton)."""
    D = x.shape[-1]
    if weight.shape != (D,) or x.dtype not in TL_DTYPES or weight.dtype not in TL_DTYPES:
        raise ValueError(f"rms_norm needs x [..., D] and weight [D] of float dtypes, got {tuple(x.shape)} "
                         f"{x.dtype} and {tuple(weight.shape)} {weight.dtype}")
    rows = x.reshape(-1, D)
    if not rows.is_contiguous():
        rows = rows.contiguous()
    out = torch.empty(rows.shape, dtype=torch.promote_types(weight.dtype, x.dtype), device=x.device)
    block_d = triton.next_power_of_2(D)
    per = max(1, min(64, 4096 // block_d))  # rows per program: ~4K elements in registers
    R = rows.shape[0]
    _rms_norm_kernel[(triton.cdiv(R, per),)](rows, weight.contiguous(), out, R, D, 1.0 / D, eps, TL_DTYPES[x.dtype],
                                             per, block_d, num_warps=4, **grid_dependency(x.device))
    return out.view(x.shape)
