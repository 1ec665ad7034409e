"""Head RMSNorm and rotate-half RoPE in one launch: the attention's q and k each took ~6 torch kernels for this
(norm, negate, concatenate, two multiplies, add) in both the BF16 and the FP4 decode step.

The arithmetic is the model's, op by op: the norm as kernels.norm computes it, then x * cos and rotate(x) * sin
each rounded to the result dtype, then their sum rounded again (torch rounds every bf16 op). The float32
multiply and add are kept apart (no fused multiply-add), so float32 results match torch's too.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from trace_lightning.kernels._common import TL_DTYPES, grid_dependency
from trace_lightning.kernels._fp4 import await_previous_grid
from trace_lightning.kernels.norm import _round_to, weighted_norm


@triton.jit
def _rope_kernel(x_ptr, w_ptr, cos_ptr, sin_ptr, out_ptr, H, sx_bt, sx_h, inv_d, eps, NORM: tl.constexpr,
                 X_DTYPE: tl.constexpr, Y_DTYPE: tl.constexpr, DH: tl.constexpr, BLOCK_H: tl.constexpr,
                 PDL: tl.constexpr = False):
    await_previous_grid(PDL)
    HALF: tl.constexpr = DH // 2
    bt = tl.program_id(0).to(tl.int64)
    hs = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    d = tl.arange(0, HALF)
    hm = hs[:, None] < H
    src = x_ptr + bt * sx_bt + hs[:, None] * sx_h + d[None, :]
    x1 = tl.load(src, mask=hm, other=0.0).to(tl.float32)
    x2 = tl.load(src + HALF, mask=hm, other=0.0).to(tl.float32)
    if NORM:  # weight * (x * rsqrt(mean(x^2) + eps)).to(x dtype), rounded to the norm's result dtype
        inv = tl.math.rsqrt((tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)) * inv_d + eps)
        x1 = weighted_norm(x1, inv, tl.load(w_ptr + d).to(tl.float32)[None, :], X_DTYPE, Y_DTYPE).to(tl.float32)
        x2 = weighted_norm(x2, inv, tl.load(w_ptr + HALF + d).to(tl.float32)[None, :], X_DTYPE,
                           Y_DTYPE).to(tl.float32)
    trig = bt * DH + d[None, :]
    c1 = tl.load(cos_ptr + trig).to(tl.float32)
    c2 = tl.load(cos_ptr + trig + HALF).to(tl.float32)
    s1 = tl.load(sin_ptr + trig).to(tl.float32)
    s2 = tl.load(sin_ptr + trig + HALF).to(tl.float32)
    OUT: tl.constexpr = out_ptr.dtype.element_ty
    o1 = _round_to(_round_to(x1 * c1, OUT).to(tl.float32) + _round_to(-x2 * s1, OUT).to(tl.float32), OUT)
    o2 = _round_to(_round_to(x2 * c2, OUT).to(tl.float32) + _round_to(x1 * s2, OUT).to(tl.float32), OUT)
    dst = out_ptr + (bt * H + hs[:, None]) * DH + d[None, :]
    tl.store(dst, o1, mask=hm)
    tl.store(dst + HALF, o2, mask=hm)


def rope(x: Tensor, cos: Tensor, sin: Tensor, norm_weight: Tensor | None = None, eps: float = 0.0) -> Tensor:
    """x (B, T, H, Dh) (last dim contiguous), cos / sin (B, T, Dh) -> rotate-half RoPE of rms_norm(x, norm_weight)
    (or of x), contiguous (B, T, H, Dh) in the dtype torch's ops would give (Triton)."""
    if x.dim() != 4 or cos.shape != (*x.shape[:2], x.shape[3]) or sin.shape != cos.shape or x.shape[3] % 2:
        raise ValueError(f"rope needs x (B, T, H, Dh) with an even Dh and cos / sin (B, T, Dh), got {tuple(x.shape)}, "
                         f"{tuple(cos.shape)} and {tuple(sin.shape)}")
    B, T, H, Dh = x.shape
    if Dh & (Dh - 1) or any(t.dtype not in TL_DTYPES for t in (x, cos, sin)):
        raise ValueError(f"rope needs a power-of-two head dim and float tensors, got Dh={Dh}, {x.dtype}, {cos.dtype}")
    if norm_weight is not None and (norm_weight.shape != (Dh,) or norm_weight.dtype not in TL_DTYPES):
        raise ValueError(f"rope's norm weight must be a float tensor ({Dh},), got {tuple(norm_weight.shape)} "
                         f"{norm_weight.dtype}")
    normed = x.dtype if norm_weight is None else torch.promote_types(norm_weight.dtype, x.dtype)
    out = torch.empty(B, T, H, Dh, dtype=torch.promote_types(normed, cos.dtype), device=x.device)
    rows = x.reshape(B * T, H, Dh)  # a view for split-off q / k of a fused projection
    if rows.stride(2) != 1:
        rows = rows.contiguous()
    block_h = min(triton.next_power_of_2(H), max(1, 4096 // Dh))
    weight = x if norm_weight is None else norm_weight.contiguous()  # unread without a norm
    _rope_kernel[(B * T, triton.cdiv(H, block_h))](rows, weight, cos.contiguous(), sin.contiguous(), out, H,
                                                   rows.stride(0), rows.stride(1), 1.0 / Dh, eps,
                                                   norm_weight is not None, TL_DTYPES[x.dtype], TL_DTYPES[normed], Dh,
                                                   block_h, num_warps=4, enable_fp_fusion=False,
                                                   **grid_dependency(x.device))
    return out
