"""The MoE router's glue after its GEMV in one launch: float cast, softmax (or sigmoid), top-k, sum, divide and
cast were ~6 torch launches per layer (topk alone is a gather and a sort kernel), ~15-20 us per layer of the
decode step at batch 64 on an H200. The GEMV stays F.linear (cuBLAS); this takes its logits.

Arithmetic of the model's Router without replay: float32 scores in torch's order (max, exp(x - max), sum,
each divided by the sum; or the sigmoid), the top-k gates, optionally divided by their float32 sum, rounded
once to the output dtype. tl.exp is not torch's expf, so gates can differ in the last float32 bits.
The experts are picked by k rounds of one max reduction over the float32 logits (as order-preserving int32
keys, carrying the lowest index among equal maxima), not over the scores: softmax and sigmoid are monotonic,
so the ids are torch.topk's (descending) wherever the top-k scores are distinct, and they never depend on how
exp rounds. Only the k picked logits are then scored. Equal logits (-0.0 and +0.0 too) go to the lowest expert
index; logits that differ but whose scores round to the same float (a saturated sigmoid, an underflowed
softmax) go to the larger logit; torch's order among equal scores is unspecified. A NaN logit ranks above all
(as in torch.topk) and scores NaN, so every id stays a valid expert.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from trace_lightning.kernels._common import grid_dependency
from trace_lightning.kernels._fp4 import await_previous_grid
from trace_lightning.kernels.norm import _round_to
from trace_lightning.sim.router import check_route_args


@triton.jit
def _flip(bits):
    """int32 bits of a float32 <-> an int32 of the same order (negative floats have their magnitude bits flipped);
    its own inverse."""
    return bits ^ ((bits >> 31) & 0x7FFFFFFF)


@triton.jit
def _route_topk_kernel(logits_ptr, gates_ptr, ids_ptr, R, E, SOFTMAX: tl.constexpr, NORMALIZE: tl.constexpr,
                       TOP_K: tl.constexpr, BLOCK_K: tl.constexpr, ROWS: tl.constexpr, BLOCK_E: tl.constexpr,
                       PDL: tl.constexpr = False):
    await_previous_grid(PDL)
    TAKEN: tl.constexpr = -2147483647  # below every float's key (-inf's is -2139095041): padding, picked lanes
    r = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    e = tl.arange(0, BLOCK_E)[None, :]
    valid = e < E  # rows past R read row R - 1 again (no all -inf row, no NaN) and store nothing
    src = logits_ptr + tl.minimum(r, R - 1)[:, None].to(tl.int64) * E + e
    x = tl.load(src, mask=valid, other=float("-inf")).to(tl.float32)
    if SOFTMAX:  # torch's order: max, exp(x - max), sum, then (below) each divided by the sum
        m = tl.max(x, axis=1)[:, None]
        total = tl.sum(tl.exp(x - m), axis=1)[:, None]  # padding lanes: exp(-inf) = 0
    # select on the logits, as order-preserving ints: a NaN above everything (torch.topk's rank), -0.0 as +0.0
    key = tl.where(x != x, 0x7FFFFFFF, tl.where(x == 0, 0, _flip(x.to(tl.int32, bitcast=True))))
    key = tl.where(valid, key, TAKEN)
    col = tl.arange(0, BLOCK_K)[None, :]
    best = tl.full((ROWS, BLOCK_K), 0, tl.int32)
    ids = tl.full((ROWS, BLOCK_K), 0, tl.int32)
    for k in tl.static_range(TOP_K):  # one reduction a round: the max, ties to the lowest index; then mask it out
        top, pick = tl.max(key, axis=1, return_indices=True, return_indices_tie_break_left=True)
        key = tl.where(e == pick[:, None], TAKEN, key)
        best = tl.where(col == k, top[:, None], best)
        ids = tl.where(col == k, pick[:, None], ids)
    picked = _flip(best).to(tl.float32, bitcast=True)  # the picked logits, bit for bit (NaN as a NaN)
    if SOFTMAX:
        gates = tl.exp(picked - m) / total
    else:
        gates = tl.sigmoid(picked)
    gates = tl.where(col < TOP_K, gates, 0.0)
    if NORMALIZE:
        gates = gates / tl.sum(gates, axis=1)[:, None]
    out = r[:, None].to(tl.int64) * TOP_K + col
    mask = (r[:, None] < R) & (col < TOP_K)
    tl.store(gates_ptr + out, _round_to(gates, gates_ptr.dtype.element_ty), mask=mask)
    tl.store(ids_ptr + out, ids.to(tl.int64), mask=mask)


def route_topk(logits: Tensor, top_k: int, scoring: str, normalize: bool,
               out_dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """logits [..., E] -> (gates [..., top_k] in out_dtype, ids [..., top_k] int64), best first: the model's
    Router on these logits without replay (Triton, one launch)."""
    check_route_args(logits, top_k, scoring, out_dtype)
    E = logits.shape[-1]
    rows = logits.reshape(-1, E)
    if not rows.is_contiguous():
        rows = rows.contiguous()
    R = rows.shape[0]
    gates = torch.empty(R, top_k, dtype=out_dtype, device=logits.device)
    ids = torch.empty(R, top_k, dtype=torch.int64, device=logits.device)
    if R:
        block_e = triton.next_power_of_2(E)
        per = max(1, 1024 // block_e)  # rows per program: ~8 logits a thread at 4 warps, a row inside one warp
        _route_topk_kernel[(triton.cdiv(R, per),)](rows, gates, ids, R, E, scoring == "softmax", bool(normalize),
                                                   top_k, triton.next_power_of_2(top_k), per, block_e, num_warps=4,
                                                   **grid_dependency(logits.device))
    shape = (*logits.shape[:-1], top_k)
    return gates.view(shape), ids.view(shape)
