"""W4A16 GEMM for decode and prefill: NVFP4 weights dequantized in registers, float32 accumulation.

Each program loads a packed weight tile [BLOCK_N, BLOCK_K / 2] and its E4M3 scales, turns them into
code * scale (exact in bf16), and feeds tl.dot with the activation tile; the per-row global scale is
applied to the float32 accumulator. Hopper has no FP4 MMA (tl.dot_scaled is emulated via bf16 there and
takes only E8M0 scales in 32-blocks, not NVFP4's E4M3 16-blocks), so the win is bytes: the weight stream
is 4.5 bits. Small M gives few tiles, so K is split across programs into float32 partials that a
deterministic sum reduces (no atomics: rollouts stay bit-reproducible).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from trace_lightning.kernels._common import (
    GEMM_TILES,
    TUNED_K_UNIT,
    autotune_on,
    dot_precision,
    fast_dequant,
    grid_dependency,
    mma_dtype,
    scale_bytes,
    sm_count,
    tuned,
)
from trace_lightning.kernels._fp4 import activation_tile_kperm, await_previous_grid, unscale, weight_tile_kperm
from trace_lightning.kernels.layout import readable_weight
from trace_lightning.kernels.reduce import sum_partials
from trace_lightning.quant import NVFP4
from trace_lightning.sim._weights import global_strides


@triton.jit
def _linear_kernel(x_ptr, w_ptr, s_ptr, g_ptr, g_sn, out_ptr, M, N, K, K_SPLIT,
                   DTYPE: tl.constexpr, PREC: tl.constexpr, SWAP: tl.constexpr, FAST: tl.constexpr,
                   WORDS: tl.constexpr, TILED: tl.constexpr, EVEN_K: tl.constexpr, BLOCK_M: tl.constexpr,
                   BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr = False):
    await_previous_grid(PDL)
    pid_m, pid_n, pid_k = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    if SWAP:  # out^T = w @ x^T: the dequantized tile is the MMA's A operand (registers), x^T the B (shared)
        acc = tl.zeros((BLOCK_N, BLOCK_M), tl.float32)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    k_lo = pid_k * K_SPLIT
    for k0 in range(k_lo, k_lo + K_SPLIT, BLOCK_K):
        w = weight_tile_kperm(w_ptr, s_ptr, rn, K, k0, rn < N, BLOCK_N, BLOCK_K, DTYPE, FAST, WORDS, TILED, EVEN_K)
        x = activation_tile_kperm(x_ptr, rm, K, k0, rm < M, BLOCK_M, BLOCK_K, DTYPE, EVEN_K)  # K in permute_k order
        if SWAP:
            acc = tl.dot(w, tl.trans(x), acc, input_precision=PREC)
        else:
            acc = tl.dot(x, tl.trans(w), acc, input_precision=PREC)
    g = unscale(tl.load(g_ptr + rn * g_sn, mask=rn < N, other=0.0), FAST)
    if SWAP:
        acc = acc * g[:, None]
        out = out_ptr + pid_k * M * N + rm[None, :] * N + rn[:, None]
        tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=(rm[None, :] < M) & (rn[:, None] < N))
    else:
        acc = acc * g[None, :]
        out = out_ptr + pid_k * M * N + rm[:, None] * N + rn[None, :]
        tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=(rm[:, None] < M) & (rn[None, :] < N))


_LINEAR = tuned(_linear_kernel, [
    triton.Config({"BLOCK_N": bn, "BLOCK_K": bk}, num_warps=w, num_stages=st)
    for bn, bk, w, st in GEMM_TILES
], key=["M", "N", "K", "K_SPLIT"])


# tools/sweep_linear.py on an H200 (words in tiles, 16-byte weight copies; qwen3-30b-a3b's wqkv 5120 x 2048 and wo
# 2048 x 4096): up to 64 rows, 64-wide N tiles and 128-wide K steps (wo M=64 15.6 -> 14.4 us); above, 128-wide N
# tiles and 64-wide K steps (M=256: wqkv 36.1 -> 30.3 us, wo 28.7 -> 24.2 us); and the fewest K splits that give
# about two programs per SM (LINEAR_FILL x SMs: 256 programs count for 132 SMs; wo M=16 split 16 -> 8, 12.2 -> 11.3 us).
LINEAR_FILL = 1.9
# Up to SWAP_MAX_ROWS rows the GEMM computes out^T = dequant(w) @ x^T: the dequantized weight tile is then the MMA's A
# operand, which Hopper's wgmma reads from registers, and the weight rows fill its 64-row M side even at decode batch
# sizes; x @ w^T puts the weight on the B side, through shared memory, with M = 16 token rows below wgmma's minimum
# tile. Wider (prefill) row tiles fill M themselves and keep x @ w^T.
SWAP_MAX_ROWS = 64


def linear_config(M: int, N: int, K: int, device: torch.device) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, split_k): enough programs to fill the chip at decode sizes (see above)."""
    block_m = 16 if M <= 16 else 32 if M <= 32 else 64
    block_n = 64 if M <= 64 else 128
    block_k = (128 if M <= 64 else 64) if K >= 128 else max(16, triton.next_power_of_2(K))
    tiles = triton.cdiv(M, block_m) * triton.cdiv(N, block_n)
    k_blocks = triton.cdiv(K, block_k)
    split = 1
    while tiles * split < LINEAR_FILL * sm_count(device) and split * 2 <= k_blocks // 2:
        split *= 2
    return block_m, block_n, block_k, split


def linear(x: Tensor, w: NVFP4, out_dtype: torch.dtype | None, split_k: int | None = None,
           blocks: tuple[int, int, int] | None = None) -> Tensor:
    if x.dim() != 2 or len(w.shape) != 2 or x.shape[1] != w.shape[1]:
        raise ValueError(f"fp4_linear needs x [M, K] and w [N, K], got {tuple(x.shape)} and {w.shape}")
    M, K = x.shape
    N = w.shape[0]
    bm, bn, bk, split = linear_config(M, N, K, x.device)
    if blocks is not None:
        bm, bn, bk = blocks
    split = split_k or split
    tune = autotune_on(x.device)
    pdl = grid_dependency(x.device)
    k_unit = TUNED_K_UNIT if tune else bk  # an autotuned BLOCK_K must divide each split's K range
    k_split = triton.cdiv(triton.cdiv(K, k_unit), split) * k_unit
    split = triton.cdiv(K, k_split)
    out_dtype = out_dtype or x.dtype
    fast = fast_dequant(x.dtype, x.device)
    w, words, tiled = readable_weight(w, fast)
    g, (g_sn,) = global_strides(w)
    out = torch.empty((split, M, N) if split > 1 else (M, N), dtype=torch.float32 if split > 1 else out_dtype,
                      device=x.device)
    args = (x.contiguous(), w.packed.contiguous(), scale_bytes(w.scales).contiguous(), g, g_sn, out,
            M, N, K, k_split, mma_dtype(x.dtype, x.device), dot_precision(x.dtype, x.device), M <= SWAP_MAX_ROWS,
            fast, words, tiled, K % k_split == 0, bm)  # even: no split's K range runs past K
    if tune:
        _LINEAR[1][lambda meta: (triton.cdiv(M, bm), triton.cdiv(N, meta["BLOCK_N"]), split)](*args, **pdl)
    else:
        _LINEAR[0][(triton.cdiv(M, bm), triton.cdiv(N, bn), split)](*args, bn, bk, num_warps=4, num_stages=3, **pdl)
    return sum_partials(out, 0, out_dtype) if split > 1 else out


def fp4_linear(x: Tensor, w: NVFP4, out_dtype: torch.dtype | None = None) -> Tensor:
    """x [M, K] (bf16/fp16/fp32, already fake-quantized) @ dequant(w [N, K]).T -> [M, N] (Triton)."""
    return linear(x, w, out_dtype)
