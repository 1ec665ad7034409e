"""Fused FP4 MoE: token-expert pairs grouped by expert, one launch for gate/up (+SiLU-mul), one for down.

Pairs are grouped by expert into tiles of BLOCK_M rows (each expert's run padded to a multiple of
BLOCK_M, vLLM-style), entirely with device ops, so there is no host sync and the step can be captured in
a CUDA graph. A tile reads only its expert's packed weights, so untouched experts cost nothing. The
`moe_down` activation is quantized per pair row (its row global needs the whole row, hence a separate
launch between the two GEMMs), which also writes it as the down GEMM's operand, code * block scale (exact in
bf16), so the GEMM loads it as a plain tile instead of decoding bytes in each of its D / BLOCK_N column
programs; per-row globals of both operands are applied to the float32 accumulator. Slots are summed by a
deterministic reduction.

Both GEMMs compute out^T = dequant(w) @ x^T: the dequantized weight tile is the MMA's A operand, which Hopper's wgmma
reads from registers, and the weight rows fill its 64-row M side even at decode batch sizes (the x @ w^T form puts
the weight on the B side, which must go through shared memory, and M = 16 pair rows below wgmma's minimum tile).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from trace_lightning.kernels._common import (
    GEMM_TILES,
    TUNED_K_UNIT,
    active_options,
    autotune_on,
    dot_precision,
    fast_dequant,
    grid_dependency,
    mma_dtype,
    mma_torch_dtype,
    scale_bytes,
    sm_count,
    tuned,
)
from trace_lightning.kernels._fp4 import activation_tile_kperm, await_previous_grid, unscale, weight_tile_kperm
from trace_lightning.kernels.layout import readable_weight
from trace_lightning.kernels.quantize import quantize_nvfp4_rows_operand
from trace_lightning.kernels.reduce import sum_partials
from trace_lightning.quant import NVFP4
from trace_lightning.sim._weights import global_strides


@triton.jit
def _align_kernel(ids_ptr, sorted_ptr, bexp_ptr, cursor_ptr, P, E, NUM_BLOCKS, BLOCK_M: tl.constexpr,
                  BLOCK_P: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_S: tl.constexpr, PDL: tl.constexpr = False):
    """One program: histogram the pairs' experts, pad each expert's run to BLOCK_M, label every tile with its
    expert, then place each pair at an atomic increment of its expert's cursor (cursor_ptr, int32 [E], set to the
    start of the expert's run). The order within an expert is the cursors' arrival order, fixed by nothing; the
    GEMMs compute every pair's row on its own and the slots are summed in top-k order, so their outputs do not
    depend on it."""
    await_previous_grid(PDL)
    ev = tl.arange(0, BLOCK_E)
    pv = tl.arange(0, BLOCK_P)
    counts = tl.zeros((BLOCK_E,), tl.int32)
    for p0 in range(0, P, BLOCK_P):
        live = p0 + pv < P
        counts += tl.histogram(tl.load(ids_ptr + p0 + pv, mask=live, other=0).to(tl.int32), BLOCK_E, mask=live)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    pad_end = tl.cumsum(padded, axis=0)
    start = pad_end - padded
    sv = tl.arange(0, BLOCK_S)
    for s0 in range(0, NUM_BLOCKS * BLOCK_M, BLOCK_S):  # every slot padding (== P) first
        tl.store(sorted_ptr + s0 + sv, tl.full((BLOCK_S,), P, tl.int64), mask=s0 + sv < NUM_BLOCKS * BLOCK_M)
    # tile b's expert is the number of experts whose padded run ends at or before tile b: a running sum of the
    # histogram of the runs' end tiles
    end_tile = pad_end // BLOCK_M
    ended = tl.zeros((), tl.int32)
    for b0 in range(0, NUM_BLOCKS, BLOCK_S):
        t = end_tile - b0
        ends = tl.histogram(t, BLOCK_S, mask=(ev < E) & (t >= 0) & (t < BLOCK_S))
        tl.store(bexp_ptr + b0 + sv, ended + tl.cumsum(ends, axis=0), mask=b0 + sv < NUM_BLOCKS)
        ended += tl.sum(ends, axis=0)
    tl.store(cursor_ptr + ev, start, mask=ev < E)
    tl.debug_barrier()  # the padding and cursor stores land before any thread's pair stores
    for p0 in range(0, P, BLOCK_P):
        live = p0 + pv < P
        e = tl.load(ids_ptr + p0 + pv, mask=live, other=0).to(tl.int32)
        slot = tl.atomic_add(cursor_ptr + e, tl.full((BLOCK_P,), 1, tl.int32), mask=live, sem="relaxed")
        tl.store(sorted_ptr + slot, (p0 + pv).to(tl.int64), mask=live)


ALIGN_CHUNK = 2048  # pairs histogrammed and placed at a time (decode batches up to 256 tokens x 8 in one chunk)
ALIGN_SLOTS = 1024  # slots / tiles written at a time
# Placing pairs by atomic cursors replaced a stable sort of each chunk (its order within an expert changed no
# output). H200, 2026-12-04: align_pairs 36.0 -> 18.9 us at 2048 pairs, 14.1 -> 11.6 at 512.


def align_pairs(topk_ids: Tensor, experts: int, block_m: int) -> tuple[Tensor, Tensor, int]:
    """Group (token, slot) pairs by expert into tiles: pair ids [blocks * block_m] (padding = P) and each tile's
    expert [blocks] (== experts past the last tile). Experts in ascending order; within an expert, in the cursors'
    arrival order. One launch, no host sync: `blocks` is an upper bound."""
    flat = topk_ids.reshape(-1).contiguous()
    P = flat.numel()
    blocks = triton.cdiv(P, block_m) + min(experts, P)
    sorted_ids = torch.empty(blocks * block_m, dtype=torch.int64, device=flat.device)
    block_expert = torch.empty(blocks, dtype=torch.int32, device=flat.device)
    cursor = torch.empty(experts, dtype=torch.int32, device=flat.device)  # per-expert placement cursors
    _align_kernel[(1,)](flat, sorted_ids, block_expert, cursor, P, experts, blocks, block_m,
                        max(16, min(ALIGN_CHUNK, triton.next_power_of_2(P))), max(16, triton.next_power_of_2(experts)),
                        ALIGN_SLOTS, num_warps=8 if P > 1024 else 4,
                        **grid_dependency(flat.device))
    return sorted_ids, block_expert, blocks


@triton.jit
def _expert_tile(ids_ptr, bexp_ptr, P, E, BLOCK_M: tl.constexpr):
    """This program's tile: (expert, live, pair ids [BLOCK_M], valid); tiles past the last expert are dead
    (live False, expert 0) and hold only padding ids (== P)."""
    pid_m = tl.program_id(0)
    e = tl.load(bexp_ptr + pid_m)
    live = e < E
    rows = tl.load(ids_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    return tl.where(live, e, 0).to(tl.int64), live, rows, rows < P


@triton.jit
def _gate_up_kernel(x_ptr, ids_ptr, bexp_ptr, w_ptr, s_ptr, g_ptr, g_se, g_sn, h_ptr, P, TOPK, E, D, I,
                    DTYPE: tl.constexpr, PREC: tl.constexpr, FAST: tl.constexpr,
                    WORDS: tl.constexpr, TILED: tl.constexpr, EVEN_K: tl.constexpr, BLOCK_M: tl.constexpr,
                    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr = False):
    await_previous_grid(PDL)
    pid_n = tl.program_id(1)
    e, live, rows, valid = _expert_tile(ids_ptr, bexp_ptr, P, E, BLOCK_M)
    tok = tl.where(valid, rows // TOPK, 0)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    nmask = rn < I
    gate_rows = e * 2 * I + rn
    up_rows = gate_rows + I
    acc_g = tl.zeros((BLOCK_N, BLOCK_M), tl.float32)  # transposed: the dequantized weight is the MMA's A operand
    acc_u = tl.zeros((BLOCK_N, BLOCK_M), tl.float32)
    k_end = tl.where(live, D, 0)
    for k0 in range(0, k_end, BLOCK_K):
        x = activation_tile_kperm(x_ptr, tok, D, k0, valid, BLOCK_M, BLOCK_K, DTYPE, EVEN_K)  # K in permute_k order
        wg = weight_tile_kperm(w_ptr, s_ptr, gate_rows, D, k0, nmask, BLOCK_N, BLOCK_K, DTYPE, FAST, WORDS, TILED,
                               EVEN_K)
        acc_g = tl.dot(wg, tl.trans(x), acc_g, input_precision=PREC)
        wu = weight_tile_kperm(w_ptr, s_ptr, up_rows, D, k0, nmask, BLOCK_N, BLOCK_K, DTYPE, FAST, WORDS, TILED,
                               EVEN_K)
        acc_u = tl.dot(wu, tl.trans(x), acc_u, input_precision=PREC)
    g_gate = unscale(tl.load(g_ptr + e * g_se + rn * g_sn, mask=nmask, other=0.0), FAST)
    g_up = unscale(tl.load(g_ptr + e * g_se + (rn + I) * g_sn, mask=nmask, other=0.0), FAST)
    gate = acc_g * g_gate[:, None]
    up = acc_u * g_up[:, None]
    h = gate / (1.0 + tl.exp(-gate)) * up
    tl.store(h_ptr + rows[None, :] * I + rn[:, None], h, mask=valid[None, :] & nmask[:, None])


@triton.jit
def _down_kernel(a_ptr, ag_ptr, ids_ptr, bexp_ptr, tw_ptr, w_ptr, s_ptr, g_ptr, g_se, g_sn, y_ptr, P, E, D, I,
                 QUANT_A: tl.constexpr, DTYPE: tl.constexpr, PREC: tl.constexpr,
                 FAST: tl.constexpr, WORDS: tl.constexpr, TILED: tl.constexpr, EVEN_K: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr = False):
    await_previous_grid(PDL)
    pid_n = tl.program_id(1)
    e, live, rows, valid = _expert_tile(ids_ptr, bexp_ptr, P, E, BLOCK_M)
    safe = tl.where(valid, rows, 0)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    nmask = rn < D
    w_rows = e * D + rn
    acc = tl.zeros((BLOCK_N, BLOCK_M), tl.float32)  # transposed, as in gate/up
    k_end = tl.where(live, I, 0)
    for k0 in range(0, k_end, BLOCK_K):
        a = activation_tile_kperm(a_ptr, safe, I, k0, valid, BLOCK_M, BLOCK_K, DTYPE, EVEN_K)  # K in permute_k order
        w = weight_tile_kperm(w_ptr, s_ptr, w_rows, I, k0, nmask, BLOCK_N, BLOCK_K, DTYPE, FAST, WORDS, TILED, EVEN_K)
        acc = tl.dot(w, tl.trans(a), acc, input_precision=PREC)
    row_scale = tl.load(tw_ptr + safe, mask=valid, other=0.0).to(tl.float32)
    if QUANT_A:  # A is code * block scale (no 2^-7, unlike the weight): only its row global is left to apply
        row_scale = tl.load(ag_ptr + safe, mask=valid, other=0.0) * row_scale
    g_w = unscale(tl.load(g_ptr + e * g_se + rn * g_sn, mask=nmask, other=0.0), FAST)
    y = acc * g_w[:, None] * row_scale[None, :]
    tl.store(y_ptr + rows[None, :] * D + rn[:, None], y, mask=valid[None, :] & nmask[:, None])


_GATE_UP = tuned(_gate_up_kernel, [
    triton.Config({"BLOCK_N": bn, "BLOCK_K": bk}, num_warps=w, num_stages=st)
    for bn, bk, w, st in GEMM_TILES
], key=["P", "D", "I", "BLOCK_M"])
_DOWN = tuned(_down_kernel, [
    triton.Config({"BLOCK_N": bn, "BLOCK_K": bk}, num_warps=w, num_stages=st)
    for bn, bk, w, st in GEMM_TILES
], key=["P", "D", "I", "BLOCK_M", "QUANT_A"])


def moe_config(pairs: int, experts: int, blocks_n: int, device: torch.device) -> tuple[int, int]:
    """(BLOCK_M, BLOCK_N): BLOCK_M about twice the mean pairs per expert, so a busy expert rarely spills into a
    second tile (each tile dequantizes the expert's weights again); narrower N tiles when there are few tiles."""
    block_m = min(64, max(16, triton.next_power_of_2(max(1, 2 * pairs // experts))))
    return block_m, 64 if fills_chip(pairs, experts, blocks_n, block_m, 64, device) else 32


def fills_chip(pairs: int, experts: int, n: int, block_m: int, block_n: int, device: torch.device) -> bool:
    """Whether (expert tiles, upper bound) x (N tiles of block_n) programs make at least two per SM."""
    return (triton.cdiv(pairs, block_m) + min(experts, pairs)) * triton.cdiv(n, block_n) >= 2 * sm_count(device)


# K tiles: with 16-row tiles 128 measured best for both GEMMs (tools/sweep_moe.py on an H200, permute_k loads:
# gate/up 263 -> 251 us per MoE call at N = 64). With 32-row tiles (decode batches of ~256 tokens) and the weights
# in tiles, gate/up takes 128-wide N tiles and 64-wide K steps (251 -> 243 us per MoE call at N = 256; before the
# tiles, 128-wide K steps had measured best there) and down 128-wide N tiles; down's 16-row tiles take 128-wide N
# tiles too while they fill the chip (N = 16 / 64: 131 / 175 -> 127 / 168 us); 64-row tiles (prefill) keep 64 /
# moe_config's N tile (unmeasured; 128 would be 203 / 223 registers, sm_90 SASS).
# KernelOptions.moe_gate_up / moe_down override these per GEMM (tools/sweep_moe.py varies them); their None block_n /
# block_k keep the functions below.


def block_k_for(block_m: int) -> int:
    """K tile of gate/up and down for tiles of block_m pair rows (see above)."""
    return 128 if block_m <= 16 else 64


def gate_up_block_n(pairs: int, experts: int, inter: int, block_m: int, device: torch.device) -> int:
    """N tile of the gate/up GEMM (see above)."""
    return 128 if block_m == 32 else moe_config(pairs, experts, inter, device)[1]


def down_block_n(pairs: int, experts: int, dim: int, block_m: int, device: torch.device) -> int:
    """N tile of the down GEMM (see above): 128 for 16- and 32-row tiles while that still fills the chip."""
    wide = block_m <= 32 and fills_chip(pairs, experts, dim, block_m, 128, device)
    return 128 if wide else moe_config(pairs, experts, dim, device)[1]


def fp4_moe(x: Tensor, w13: NVFP4, w2: NVFP4, topk_ids: Tensor, topk_weights: Tensor,
            quantize_intermediate: bool = True) -> tuple[Tensor, NVFP4 | None]:
    """x [N, D], w13 [E, 2I, D] (gate rows then up rows), w2 [E, D, I] -> (out [N, D], moe_down NVFP4
    [N, k, I] or None); only experts some token picked are read (Triton)."""
    from trace_lightning.sim.moe import check_moe_args

    E, I, k = check_moe_args(x, w13, w2, topk_ids, topk_weights)
    N, D = x.shape
    P = N * k
    dev = x.device
    dt, prec, fast = mma_dtype(x.dtype, dev), dot_precision(x.dtype, dev), fast_dequant(x.dtype, dev)
    w13, words13, tiled13 = readable_weight(w13, fast)
    w2, words2, tiled2 = readable_weight(w2, fast)
    block_m = moe_config(P, E, I, dev)[0]
    sorted_ids, block_expert, blocks = align_pairs(topk_ids.to(torch.int64), E, block_m)
    h = torch.empty(P, I, dtype=torch.float32, device=dev)
    tune = autotune_on(dev)
    pdl = grid_dependency(dev)
    g13, g13_strides = global_strides(w13)
    g2, g2_strides = global_strides(w2)
    args = (x.contiguous(), sorted_ids, block_expert, w13.packed.contiguous(), scale_bytes(w13.scales).contiguous(),
            g13, *g13_strides, h, P, k, E, D, I, dt, prec, fast, words13, tiled13)
    launch = active_options().moe_gate_up
    bn, bk = launch.block_n or gate_up_block_n(P, E, I, block_m, dev), launch.block_k or block_k_for(block_m)
    if tune:
        _GATE_UP[1][lambda meta: (blocks, triton.cdiv(I, meta["BLOCK_N"]))](*args, D % TUNED_K_UNIT == 0, block_m,
                                                                            **pdl)
    else:
        _GATE_UP[0][(blocks, triton.cdiv(I, bn))](*args, D % bk == 0, block_m, bn, bk, num_warps=launch.warps,
                                                  num_stages=launch.stages, **pdl)
    if quantize_intermediate:  # A = code * block scale in the MMA dtype, its row global for the epilogue
        q, a = quantize_nvfp4_rows_operand(h.view(N, k, I), mma_torch_dtype(x.dtype, dev))
        a_global = q.global_scale
    else:
        q, a, a_global = None, h, h  # a_global unread (QUANT_A off)
    y = torch.empty(P, D, dtype=torch.float32, device=dev)
    args = (a, a_global, sorted_ids, block_expert, topk_weights.contiguous(), w2.packed.contiguous(),
            scale_bytes(w2.scales).contiguous(), g2, *g2_strides, y, P, E, D, I,
            q is not None, dt, prec, fast, words2, tiled2)
    launch = active_options().moe_down
    bn, bk = launch.block_n or down_block_n(P, E, D, block_m, dev), launch.block_k or block_k_for(block_m)
    if tune:
        _DOWN[1][lambda meta: (blocks, triton.cdiv(D, meta["BLOCK_N"]))](*args, I % TUNED_K_UNIT == 0, block_m, **pdl)
    else:
        _DOWN[0][(blocks, triton.cdiv(D, bn))](*args, I % bk == 0, block_m, bn, bk, num_warps=launch.warps,
                                               num_stages=launch.stages, **pdl)
    return sum_partials(y.view(N, k, D), 1, x.dtype), q
