"""Is the MoE gate/up GEMM limited by how its weight tiles lie in memory? A probe, not a kernel of the engine.

Run: python tools/probe_layout.py   (CUDA only)
The gate/up K loop reads, per program and K tile, 2 x BLOCK_N rows of BLOCK_K / 2 packed bytes (64 bytes at 1 KB
strides) and BLOCK_K / 16 scale bytes per row (8 bytes at 128-byte strides). This probe runs the same loop
(`_probe_kernel`: the engine's loads, dequantization and MMA, over all 128 experts at the batch-64 decode grid)
on the same bytes laid out three ways: row-major words, each program's BLOCK_N x BLOCK_K tile (scales too) one
contiguous run, and runs of 32 rows (the engine's tiles, trace_lightning/quant/words.py); and each loop with the
dequantization and MMA replaced by a quarter-size MMA on barely decoded words (loads only), so the times say
whether the access pattern or the arithmetic bounds the kernel.
"""

from __future__ import annotations

import sys
from functools import partial

import torch
import triton
import triton.language as tl
from _bench import COPY_CEILING, graph_ms

from trace_lightning.kernels._fp4 import dequant_tile_kperm, permute_k

E, I, D, BLOCK_N, BLOCK_K, TOKENS = 128, 768, 2048, 64, 128, 16


@triton.jit
def _tile_offsets(e, rt, k0, ROWS, COLS, TILED: tl.constexpr, R: tl.constexpr, C: tl.constexpr, TILE_R: tl.constexpr):
    """Offsets of the [R, C] block of matrix e at row block rt, column k0 (in elements of a [E, ROWS, COLS] array),
    row-major or in contiguous [TILE_R, C] tiles (TILE_R divides R)."""
    r = rt * R + tl.arange(0, R)[:, None]
    c = tl.arange(0, C)[None, :]
    if TILED:
        return ((e * (ROWS // TILE_R) + r // TILE_R) * (COLS // C) + k0 // C) * (TILE_R * C) + r % TILE_R * C + c
    else:
        return (e * ROWS + r) * COLS + k0 + c


@triton.jit
def _per_word(scales, R: tl.constexpr, NB: tl.constexpr):
    """int32 [R, 2 NB]: each block's scale byte beside both of its words."""
    return tl.reshape(tl.broadcast_to(scales.to(tl.int32)[:, :, None], (R, NB, 2)), (R, 2 * NB))


@triton.jit
def _probe_kernel(w_ptr, s_ptr, x_ptr, out_ptr, I, D, TILED: tl.constexpr, MATH: tl.constexpr,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, TILE_R: tl.constexpr):
    e, pn = tl.program_id(0), tl.program_id(1)
    WORDS: tl.constexpr = BLOCK_K // 8
    NB: tl.constexpr = BLOCK_K // 16
    acc_g = tl.zeros((BLOCK_N, BLOCK_M), tl.float32)
    acc_u = tl.zeros((BLOCK_N, BLOCK_M), tl.float32)
    x_rows = tl.arange(0, BLOCK_M)
    for k0 in range(0, D, BLOCK_K):
        gw = tl.load(w_ptr + _tile_offsets(e, pn, k0 // 8, 2 * I, D // 8, TILED, BLOCK_N, WORDS, TILE_R))
        gs = tl.load(s_ptr + _tile_offsets(e, pn, k0 // 16, 2 * I, D // 16, TILED, BLOCK_N, NB, TILE_R))
        uw = tl.load(w_ptr + _tile_offsets(e, pn + I // BLOCK_N, k0 // 8, 2 * I, D // 8, TILED, BLOCK_N, WORDS,
                                           TILE_R))
        us = tl.load(s_ptr + _tile_offsets(e, pn + I // BLOCK_N, k0 // 16, 2 * I, D // 16, TILED, BLOCK_N, NB,
                                           TILE_R))
        if MATH:
            x = permute_k(tl.load(x_ptr + x_rows[:, None] * D + k0 + tl.arange(0, BLOCK_K)[None, :]), BLOCK_M,
                          BLOCK_K)
            wg = dequant_tile_kperm(gw, gs, BLOCK_N, BLOCK_K, tl.bfloat16, True, True)
            acc_g = tl.dot(wg, tl.trans(x), acc_g)
            wu = dequant_tile_kperm(uw, us, BLOCK_N, BLOCK_K, tl.bfloat16, True, True)
            acc_u = tl.dot(wu, tl.trans(x), acc_u)
        else:  # the same loads into one cheap quarter-size MMA (so that Triton still pipelines them)
            x = tl.load(x_ptr + x_rows[:, None] * D + k0 + tl.arange(0, WORDS * 2)[None, :])
            t = (gw ^ uw ^ _per_word(gs, BLOCK_N, NB) ^ _per_word(us, BLOCK_N, NB)) & 0x3F3F3F3F
            lo = (t & 0xFFFF).to(tl.int16).to(tl.bfloat16, bitcast=True)
            hi = (t >> 16).to(tl.int16).to(tl.bfloat16, bitcast=True)
            acc_g = tl.dot(tl.reshape(tl.join(lo, hi), (BLOCK_N, WORDS * 2)), tl.trans(x), acc_g)
    out = tl.sum(tl.sum(acc_g + acc_u, axis=1), axis=0)
    tl.store(out_ptr + e * tl.num_programs(1) + pn, out)


def main() -> None:
    if not torch.cuda.is_available():
        sys.exit("probe_layout needs a CUDA device")
    torch.manual_seed(0)
    words = torch.randint(-2**31, 2**31 - 1, (E, 2 * I, D // 8), device="cuda", dtype=torch.int32)
    scales = torch.randint(0x30, 0x40, (E, 2 * I, D // 16), device="cuda", dtype=torch.uint8)  # normal E4M3
    x = torch.randn(TOKENS, D, device="cuda", dtype=torch.bfloat16)
    out = torch.empty(E * I // BLOCK_N, device="cuda")
    nbytes = words.numel() * 4 + scales.numel()
    grid = (E, I // BLOCK_N)
    print(f"# gate/up weights of {E} experts: {nbytes / 1e6:.0f} MB; grid {grid}, tile {BLOCK_N} x {BLOCK_K}, "
          f"{TOKENS} token rows, 4 warps, 3 stages")
    print("| layout | loop | us | % of 4.25 TB/s |\n|---|---|---|---|")
    for math in (True, False):
        for tiled, tile_r in ((False, BLOCK_N), (True, BLOCK_N), (True, 32)):
            run = partial(_probe_kernel[grid], words, scales, x, out, I, D, tiled, math, TOKENS, BLOCK_N, BLOCK_K,
                          tile_r, num_warps=4, num_stages=3)
            ms = graph_ms(run)
            layout = f"tiles of {tile_r} rows" if tiled else "rows"
            print(f"| {layout} | {'dequant + MMA' if math else 'loads only'} | {ms * 1e3:.1f} | "
                  f"{nbytes / (ms * 1e-3) / COPY_CEILING * 100:.1f} |", flush=True)

if __name__ == "__main__":
    main()
