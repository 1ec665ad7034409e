"""trace_exact's GEMMs on the Triton backend, each one launch with the bits of its torch twin in `exact.arith`.

`exact_fp4_gemm`, the W4A4 product: `arith.fp4_matmul`'s bits.

A row's result must not depend on the rows beside it, the tile shapes or prefill versus decode. Here that holds
because nothing is rounded until the end: a 16-wide block's sum of (2 * E2M1) products is an integer of at most
2304, exact in the MMA's float32 accumulator; times the two blocks' E4M3 scales * 2^9 (integers below 2^18) it is
below 2^48, and the float64 sum of up to 1024 such terms (EXACT_K) stays exact whatever the order. Longer
reductions add exact 1024-wide partials in order, then the sum is scaled by 2^-20 and the two row globals in float64
and rounded once to float32: the same operations, in the same order, as `arith.fp4_matmul`, so the two agree bit for
bit (tested), and the rollout on this kernel computes what training computes on either.

Groups (an MoE's experts): rows sorted by group, `counts` a group; each program takes BLOCK_M rows of one group,
found from device tensors of a static size, so nothing is read back to the host.

`exact_tree_bmm`, the float32 products by halving trees (the attention's q.k and P.V, per head; `exact_tree_matmul`
for one matrix: router, lm head): `arith.tree_bmm` / `arith.tree_matmul`'s bits. Each output is the halving tree over
its K products, zero-padded to a power of two, computed in registers (products, then pairs i and i + K/2 added, and so
on), compiled without fused multiply-adds, which would round a product and a sum as one.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from trace_lightning.kernels._common import mma_dtype
from trace_lightning.kernels._fp4 import e4m3_to_f32
from trace_lightning.quant import NVFP4
from trace_lightning.quant.words import canonical
from trace_lightning.sim._weights import row_globals

EXACT_K = 1024
"""Reduction length whose float64 sum of FP4 integer products is exact (arith.EXACT_K)."""
BLOCK_M, BLOCK_N = 16, 64


@triton.jit
def _twice_e2m1(codes, DOT: tl.constexpr):
    """2 * E2M1 value of int32 codes, an integer in [-12, 12] by integer arithmetic (0, 1, 2, 3, then (2 | 3) << e
    for exponents 1-3), exact in fp16 and float32. Integers rather than the fp16 bit trick of the FP4 GEMMs: nothing
    here depends on how a conversion treats fp16 subnormals."""
    m = codes & 7
    magnitude = tl.where(m < 2, m, (2 + (m & 1)) << tl.maximum((m >> 1) - 1, 0))
    return tl.where((codes & 8) != 0, -magnitude, magnitude).to(DOT)


@triton.jit
def _block_codes(ptr, rows, half, kb, ok):
    """int32 codes [rows, 16] of 16-wide block kb, column k from byte k // 2's nibble k % 2. Each byte is loaded twice
    rather than split by join and reshape: with that split, every tensor-core dot on an H100 gave wrong products while
    the FMA dot was right, likeliest because the two operands' codes reached the MMA in different K orders. In this
    form every dot kind agrees with the reference on an H100 (tools/exact_kernel_check.py, 2026-12-07)."""
    k = tl.arange(0, 16)
    packed = tl.load(ptr + rows[:, None] * half + kb * 8 + (k // 2)[None, :], mask=ok[:, None], other=0).to(tl.int32)
    return (packed >> (4 * (k % 2))[None, :]) & 15


@triton.jit
def _exact_fp4_gemm_kernel(
    a_ptr, a_scale_ptr, a_global_ptr,  # rows [P, K/2] uint8, [P, K/16] E4M3 bytes, [P] float32
    b_ptr, b_scale_ptr, b_global_ptr,  # weights [G, N, K/2], [G, N, K/16], [G, N]
    out_ptr,  # [P, N] float32
    tile_group_ptr, tile_start_ptr, tile_end_ptr,  # per program along axis 0: its group and rows [start, end)
    N, K,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, EXACT_K: tl.constexpr, DOT: tl.constexpr,
    PRECISION: tl.constexpr,
):
    tile, pid_n = tl.program_id(0), tl.program_id(1)
    start, end = tl.load(tile_start_ptr + tile), tl.load(tile_end_ptr + tile)
    if start >= end:
        return
    group = tl.load(tile_group_ptr + tile).to(tl.int64)
    rows = start + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok, col_ok = rows < end, cols < N
    rows64, cols64 = rows.to(tl.int64), cols.to(tl.int64)
    b_rows = group * N + cols64  # the group's weight rows
    half, blocks = K // 2, K // 16
    total = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float64)
    for k0 in range(0, K, EXACT_K):
        part = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float64)
        for kb in range(k0 // 16, tl.minimum(k0 + EXACT_K, K) // 16):
            a = _twice_e2m1(_block_codes(a_ptr, rows64, half, kb, row_ok), DOT)
            b = _twice_e2m1(_block_codes(b_ptr, b_rows, half, kb, col_ok), DOT)
            block = tl.dot(a, tl.trans(b), input_precision=PRECISION)  # integers <= 2304: exact in float32
            a_scale = tl.load(a_scale_ptr + rows64 * blocks + kb, mask=row_ok, other=0).to(tl.int32)
            b_scale = tl.load(b_scale_ptr + b_rows * blocks + kb, mask=col_ok, other=0).to(tl.int32)
            a_int = (e4m3_to_f32(a_scale) * 512.0).to(tl.float64)  # E4M3 * 2^9: an integer below 2^18
            b_int = (e4m3_to_f32(b_scale) * 512.0).to(tl.float64)
            part += block.to(tl.float64) * (a_int[:, None] * b_int[None, :])
        total += part  # exact partials added in order, as arith.fp4_matmul adds them
    a_global = tl.load(a_global_ptr + rows64, mask=row_ok, other=0.0).to(tl.float64)
    b_global = tl.load(b_global_ptr + b_rows, mask=col_ok, other=0.0).to(tl.float64)
    out = total * 0.00000095367431640625 * a_global[:, None] * b_global[None, :]  # 2^-20, then the globals
    tl.store(out_ptr + rows64[:, None] * N + cols64[None, :], out.to(tl.float32),
             mask=row_ok[:, None] & col_ok[None, :])


def group_tiles(counts: Tensor, rows: int, block_m: int = BLOCK_M) -> tuple[Tensor, Tensor, Tensor]:
    """(group, first row, end row) of each of rows // block_m + groups programs, for `rows` rows sorted by group with
    `counts` (G,) a group: BLOCK_M-row tiles that never span two groups; programs past the last tile get no rows.
    Device ops of static shapes (a CUDA graph can hold them)."""
    G = counts.numel()
    counts = counts.to(torch.int64)
    tiles = (counts + block_m - 1) // block_m
    tile_ends = tiles.cumsum(0)
    tile = torch.arange(rows // block_m + G, device=counts.device)
    group = torch.searchsorted(tile_ends, tile, right=True)
    used = group < G
    group = group.clamp(max=G - 1)
    row_starts = counts.cumsum(0) - counts
    start = row_starts[group] + (tile - (tile_ends - tiles)[group]) * block_m
    end = torch.minimum(start + block_m, row_starts[group] + counts[group])
    start, end = torch.where(used, start, 0), torch.where(used, end, 0)
    return group.to(torch.int32), start.to(torch.int32), end.to(torch.int32)


def exact_fp4_gemm(xq: NVFP4, w: NVFP4, counts: Tensor | None = None, *, dot: tl.dtype | None = None,
                   precision: str | None = None) -> Tensor:
    """Activation rows xq [P, K] (per-row globals) @ FP4 weight w [N, K] (or [G, N, K] with rows sorted by group,
    `counts` (G,) a group) -> float32 [P, N], bit for bit `arith.fp4_matmul` of their FP4 integers.

    `dot` and `precision` override the MMA operands' Triton dtype and input precision (default fp16, "tf32" on
    CUDA): each represents the block sums exactly, so a diagnosis (tools/exact_kernel_check.py) can vary them."""
    w = canonical(w)
    P, K = xq.packed.shape[0], xq.packed.shape[-1] * 2
    if K % 16 or w.packed.shape[-1] * 2 != K:
        raise ValueError(f"exact_fp4_gemm needs K a multiple of 16 on both sides, got {K} and "
                         f"{w.packed.shape[-1] * 2}")
    stacked = w.packed.dim() == 3
    G, N = (w.packed.shape[0], w.packed.shape[1]) if stacked else (1, w.packed.shape[0])
    if counts is None:
        if stacked:
            raise ValueError("a stack of weights [G, N, K] needs the rows' counts a group")
        counts = torch.full((1,), P, dtype=torch.int64, device=xq.packed.device)
    group, start, end = group_tiles(counts, P)
    a_global = xq.global_scale.reshape(-1).float().contiguous()
    if a_global.numel() != P:
        raise ValueError(f"exact_fp4_gemm needs one global scale a row ({P}), got {a_global.numel()}")
    out = torch.empty(P, N, dtype=torch.float32, device=xq.packed.device)
    if P == 0:
        return out
    device = xq.packed.device
    grid = (group.numel(), triton.cdiv(N, BLOCK_N))
    _exact_fp4_gemm_kernel[grid](
        xq.packed.contiguous(), xq.scales.contiguous().view(torch.uint8), a_global,
        w.packed.contiguous(), w.scales.contiguous().view(torch.uint8), row_globals(w).float().contiguous(),
        out, group, start, end, N, K,
        BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, EXACT_K=EXACT_K, DOT=dot or mma_dtype(torch.float16, device),
        PRECISION=precision or ("ieee" if device.type != "cuda" else "tf32"),
    )
    return out


@triton.jit
def _tree_bmm_kernel(a_ptr, b_ptr, out_ptr, H, GROUP, M, N, K,
                     sa_b, sa_h, sa_m, sa_k, sb_b, sb_h, sb_n, sb_k, KP: tl.constexpr, LEVELS: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    tiles_n = tl.cdiv(N, BLOCK_N)
    tile, z = tl.program_id(0), tl.program_id(1)  # z = batch * H + head; b's head is head // GROUP
    batch, head = (z // H).to(tl.int64), (z % H).to(tl.int64)
    rows = (tile // tiles_n) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = (tile % tiles_n) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok, col_ok, ks = rows < M, cols < N, tl.arange(0, KP)
    k_ok = (ks < K)[None, :]
    a_base = a_ptr + batch * sa_b + head * sa_h
    b_base = b_ptr + batch * sb_b + (head // GROUP) * sb_h
    a = tl.load(a_base + rows.to(tl.int64)[:, None] * sa_m + ks[None, :] * sa_k, mask=row_ok[:, None] & k_ok,
                other=0.0)
    b = tl.load(b_base + cols.to(tl.int64)[:, None] * sb_n + ks[None, :] * sb_k, mask=col_ok[:, None] & k_ok,
                other=0.0)
    p = a[:, None, :] * b[None, :, :]  # [BLOCK_M, BLOCK_N, KP] products; zeros past K
    for level in tl.static_range(LEVELS):  # p[..., i] + p[..., i + half]
        lo, hi = tl.split(tl.permute(tl.reshape(p, (BLOCK_M, BLOCK_N, 2, KP >> (level + 1))), (0, 1, 3, 2)))
        p = lo + hi
    out = out_ptr + z.to(tl.int64) * M * N + rows.to(tl.int64)[:, None] * N + cols[None, :]
    tl.store(out, tl.reshape(p, (BLOCK_M, BLOCK_N)), mask=row_ok[:, None] & col_ok[None, :])


TREE_TILE_PRODUCTS = 1 << 14
"""Products a program holds in registers (BLOCK_M x BLOCK_N x K padded)."""


def exact_tree_bmm(a: Tensor, b: Tensor) -> Tensor:
    """a [B, H, M, K] @ b [B, Hb, N, K].T -> float32 [B, H, M, N], head h of a through head h // (H / Hb) of b (grouped
    query attention), each output the halving tree of its K products (arith.tree_sum's bits); any strides."""
    (B, H, M, K), (Bb, Hb, N, Kb) = a.shape, b.shape
    if a.dim() != 4 or b.dim() != 4 or Bb != B or Kb != K or H % max(Hb, 1):
        raise ValueError(f"exact_tree_bmm needs a [B, H, M, K] and b [B, Hb, N, K] with Hb dividing H, got "
                         f"{tuple(a.shape)} and {tuple(b.shape)}")
    out = torch.empty(B, H, M, N, dtype=torch.float32, device=a.device)
    if out.numel() == 0:
        return out
    a, b = a.float(), b.float()
    kp = triton.next_power_of_2(max(K, 1))
    block_m = 2 if kp <= TREE_TILE_PRODUCTS // 4 else 1
    block_n = max(1, TREE_TILE_PRODUCTS // (kp * block_m))
    grid = (triton.cdiv(M, block_m) * triton.cdiv(N, block_n), B * H)
    _tree_bmm_kernel[grid](a, b, out, H, H // Hb, M, N, K, *a.stride(), *b.stride(), kp, kp.bit_length() - 1,
                           block_m, block_n, enable_fp_fusion=False)
    return out


def exact_tree_matmul(a: Tensor, b: Tensor) -> Tensor:
    """a [M, K] @ b [N, K].T in float32, each output the halving tree of its K products: arith.tree_matmul's bits."""
    if a.dim() != 2 or b.dim() != 2 or a.shape[1] != b.shape[1]:
        raise ValueError(f"exact_tree_matmul needs a [M, K] and b [N, K], got {tuple(a.shape)} and {tuple(b.shape)}")
    return exact_tree_bmm(a[None, None], b[None, None])[0, 0]
