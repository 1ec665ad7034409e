"""FP4 KV cache kernels: fused quantize-on-append, and split-KV decode attention over the packed cache.

The cache is contiguous per (batch, kv head) [B, Hkv, S, ...] (not paged): a decode program streams one
head's keys as long unit-stride runs, and the engine's rollouts have a fixed max length, so paging buys
little here. Keys and values are dequantized in registers as code * block scale (exact in bf16); the
per-token-head global scale is folded into the scores (keys) and into the probabilities (values), so
no rounding is added beyond the bf16 MMA operands. Long contexts are split over programs (flash-decoding)
and merged by a second small kernel. With the values in value tiles (trace_lightning/quant/kv_tiles.py) the
decoded V words are the P V MMA's operand as they come (two keys per register, in its lane order); in rows they
had to be transposed through shared memory, which bounded the loop (H200, B=250 / 16K: 43 -> 65% of 4.25 TB/s).
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

import torch
import triton
import triton.language as tl
from torch import Tensor

from trace_lightning.kernels._common import (
    AttentionLaunch,
    active_options,
    autotune_on,
    dot_precision,
    fast_dequant,
    grid_dependency,
    mma_dtype,
    scale_bytes,
    sm_count,
    tuned,
)
from trace_lightning.kernels._fp4 import (
    _split_bf16x2,
    _word_codes_times_scale,
    abs_bits_max,
    await_previous_grid,
    dequant_tile,
    e4m3_to_f32,
    load_packed,
    load_scales,
    scale_bf16_bits,
    to_word_layout,
    unpack_codes,
    unscale,
    word_pair_bits,
)
from trace_lightning.kernels.quantize import nvfp4_tile, row_global_from_bits
from trace_lightning.quant import NVFP4
from trace_lightning.quant.kv_tiles import half_word_masks

if TYPE_CHECKING:
    from trace_lightning.ops import FP4KVLayer


HALF_WORD_LO, HALF_WORD_HI = (tl.constexpr(m) for m in half_word_masks())  # a value-tile word's two keys' bits
_POW2_126 = tl.constexpr(2.0**126)  # the word decoder's code * 2^-126 (read as float32) -> code


@triton.jit
def _write_value_tiles(c_packed, c_scales, packed, byte, dest, ok, DH: tl.constexpr, BLOCK_R: tl.constexpr,
                       BLOCK_D: tl.constexpr):
    """Rows' NVFP4 values into the cache's value tiles (trace_lightning/quant/kv_tiles.py) at cache rows dest (< 0:
    skipped). A key shares each word with the other key of its pair, which another program may write at the same
    time, so its half of the word is cleared and set by two atomics; its scale bytes are its own."""
    NB: tl.constexpr = DH // 16
    write = ok & (dest >= 0)
    tile, key = dest // 16, dest % 16
    q, t, p = key // 8, key % 8 // 2, key % 2
    vbytes = (unpack_codes(packed, BLOCK_R, BLOCK_D) << (4 * p)[:, None]).to(tl.uint8)  # byte d: its code's nibble
    words = to_word_layout(vbytes, BLOCK_R, 2 * BLOCK_D)  # word w holds d = 4 w .. 4 w + 3
    w = tl.arange(0, BLOCK_D // 4)
    row_word = tile * (32 * NB) + q * (16 * NB) + t * 4
    ptr = c_packed.to(tl.pointer_type(tl.int32)) + row_word[:, None] + (w // 4 * 16 + w % 4)[None, :]
    wmask = write[:, None] & (w[None, :] < DH // 4)
    keep = tl.where(p == 0, HALF_WORD_HI, HALF_WORD_LO)[:, None]  # the partner's bits
    tl.atomic_and(ptr, tl.broadcast_to(keep, (BLOCK_R, BLOCK_D // 4)), mask=wmask, sem="relaxed")
    tl.atomic_or(ptr, words.to(tl.int32, bitcast=True), mask=wmask, sem="relaxed")
    g = tl.arange(0, BLOCK_D // 16)
    s_off = (tile * (16 * NB) + (t * 2 + q) * 2 + p)[:, None] + (g * 16)[None, :]
    tl.store(c_scales + s_off, byte.to(tl.uint8), mask=write[:, None] & (g[None, :] < NB))


@triton.jit
def _append_one(x_ptr, packed_ptr, scales_ptr, g_ptr, c_packed, c_scales, c_g, rows, dest, R,
                DH: tl.constexpr, WORDS: tl.constexpr, BLOCK_R: tl.constexpr,
                BLOCK_D: tl.constexpr, TILES: tl.constexpr = False):
    cols = tl.arange(0, BLOCK_D)
    x = tl.load(x_ptr + rows[:, None] * DH + cols[None, :], mask=(rows[:, None] < R) & (cols[None, :] < DH),
                other=0.0).to(tl.float32)
    g = row_global_from_bits(abs_bits_max(x, 1))
    inv_g = tl.math.div_rn(tl.full((BLOCK_R,), 1.0, tl.float32), g)
    packed, byte = nvfp4_tile(x, g, inv_g, True, BLOCK_R, BLOCK_D)
    half = tl.arange(0, BLOCK_D // 2)
    nb = tl.arange(0, BLOCK_D // 16)
    ok = rows < R
    pm = ok[:, None] & (half[None, :] < DH // 2)
    sm = ok[:, None] & (nb[None, :] < DH // 16)
    tl.store(packed_ptr + rows[:, None] * (DH // 2) + half[None, :], packed, mask=pm)
    tl.store(scales_ptr + rows[:, None] * (DH // 16) + nb[None, :], byte.to(tl.uint8), mask=sm)
    tl.store(g_ptr + rows, g, mask=ok)
    write = dest >= 0
    if TILES:  # values in the cache's value tiles (the record keeps the stored order)
        _write_value_tiles(c_packed, c_scales, packed, byte, dest, ok, DH, BLOCK_R, BLOCK_D)
    elif WORDS:  # the cache copy in the kernels' word layout (the record keeps the stored order)
        wv = tl.arange(0, BLOCK_D // 8)
        tl.store(c_packed.to(tl.pointer_type(tl.uint32)) + dest[:, None] * (DH // 8) + wv[None, :],
                 to_word_layout(packed, BLOCK_R, BLOCK_D), mask=ok[:, None] & (wv[None, :] < DH // 8) & write[:, None])
    else:
        tl.store(c_packed + dest[:, None] * (DH // 2) + half[None, :], packed, mask=pm & write[:, None])
    if not TILES:
        tl.store(c_scales + dest[:, None] * (DH // 16) + nb[None, :], byte.to(tl.uint8), mask=sm & write[:, None])
    tl.store(c_g + dest, g, mask=ok & write)


@triton.jit
def _append_kernel(k_ptr, v_ptr, pos_ptr, kp, ks, kg, vp, vs, vg, ckp, cks, ckg, cvp, cvs, cvg,
                   R, T, H, S, DH: tl.constexpr, WORDS: tl.constexpr, TILES: tl.constexpr,
                   BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr, PDL: tl.constexpr = False):
    await_previous_grid(PDL)
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)  # row = (b * T + t) * H + h
    h = rows % H
    bt = rows // H
    b = bt // T
    pos = tl.load(pos_ptr + bt, mask=rows < R, other=-1)
    dest = tl.where(pos >= 0, (b * H + h).to(tl.int64) * S + pos, -1)  # cache row (b, h, pos)
    _append_one(k_ptr, kp, ks, kg, ckp, cks, ckg, rows, dest, R, DH, WORDS, BLOCK_R, BLOCK_D)
    _append_one(v_ptr, vp, vs, vg, cvp, cvs, cvg, rows, dest, R, DH, WORDS, BLOCK_R, BLOCK_D, TILES)


def kv_append(layer: FP4KVLayer, k: Tensor, v: Tensor, positions: Tensor) -> tuple[NVFP4, NVFP4]:
    """Quantize k, v [B, T, Hkv, Dh] per token-head row and write them at positions [B, T] (< 0: skipped),
    in one launch; returns the NVFP4 k and v in [B, T, Hkv, ...] layout for the record (Triton)."""
    B, Hkv, S, Dh = layer.shape
    if k.shape != v.shape or k.dim() != 4 or (k.shape[0], k.shape[2], k.shape[3]) != (B, Hkv, Dh):
        raise ValueError(f"k/v must be [B, T, Hkv, Dh] = [{B}, T, {Hkv}, {Dh}], got {tuple(k.shape)}")
    T = k.shape[1]
    if positions.shape != (B, T):
        raise ValueError(f"positions must be [B, T] = {(B, T)}, got {tuple(positions.shape)}")
    R = B * T * Hkv
    dev = k.device
    outs = [(torch.empty(B, T, Hkv, Dh // 2, dtype=torch.uint8, device=dev),
             torch.empty(B, T, Hkv, Dh // 16, dtype=torch.uint8, device=dev),
             torch.empty(B, T, Hkv, 1, dtype=torch.float32, device=dev)) for _ in range(2)]
    block_d = triton.next_power_of_2(Dh)
    block_r = max(1, min(2048 // block_d, triton.next_power_of_2(R)))
    _append_kernel[(triton.cdiv(R, block_r),)](
        k.contiguous(), v.contiguous(), positions.to(torch.int64).contiguous(), *outs[0], *outs[1],
        layer.k_packed, scale_bytes(layer.k_scales), layer.k_global,
        layer.v_packed, scale_bytes(layer.v_scales), layer.v_global,
        R, T, Hkv, S, Dh, layer.words, layer.value_tiles, block_r, block_d, num_warps=4,
        **grid_dependency(dev))
    return tuple(NVFP4(p, s.view(torch.float8_e4m3fn), g) for p, s, g in outs)  # type: ignore[return-value]


@triton.jit
def _tile_scales(word, shift: tl.constexpr, valid, FAST: tl.constexpr, MASKED: tl.constexpr):
    """The scale byte at `shift` of int32 scale words, 0 where the key is not valid (MASKED): as the bf16 bits of
    scale * 2^119 (FAST, int32 in 0..0xFFFF) or as the float32 scale."""
    byte = ((word >> shift) & 0xFF).to(tl.uint8)
    if FAST:
        value = scale_bf16_bits(byte)
    else:
        value = e4m3_to_f32(byte.to(tl.int32))
    if MASKED:
        value = tl.where(valid, value, 0)
    return value


@triton.jit
def _value_tile_t(vp, vs, base, s0, hi, DH: tl.constexpr, BLOCK_S: tl.constexpr, DTYPE: tl.constexpr,
                  FAST: tl.constexpr, MASKED: tl.constexpr = True):
    """V^T [DH, BLOCK_S] of keys s0 .. s0 + BLOCK_S (MASKED: zero from hi on) from the value tiles of a cache whose
    head starts at row `base` (trace_lightning/quant/kv_tiles.py). Rows come in the order r = (4 i + c) * NB + g,
    i.e. row r holds d = 16 g + 4 c + i (value_tile_dims): a thread's rows are then exactly the 16 head dimensions of
    its 4 words, and its key pairs the MMA's, so the decoded tile is the MMA operand with no shared-memory transpose."""
    NB: tl.constexpr = DH // 16
    BT: tl.constexpr = BLOCK_S // 16
    bt = tl.arange(0, BT)
    q = tl.arange(0, 2)
    g = tl.arange(0, NB)
    t = tl.arange(0, 4)
    c = tl.arange(0, 4)
    tile = (base + s0) // 16 + bt
    key0 = s0 + 16 * bt[:, None, None] + 2 * t[None, None, :]  # [BT, 1, 4]: key (q = 0, p = 0) of each t
    woff = ((tile * (32 * NB))[:, None, None, None, None] + (q * (16 * NB))[None, :, None, None, None]
            + (g * 16)[None, None, :, None, None] + (t * 4)[None, None, None, :, None] + c[None, None, None, None, :])
    soff = (tile * (4 * NB))[:, None, None] + (g * 4)[None, :, None] + t[None, None, :]
    if MASKED:
        wvalid = (key0[:, None, :, :, None] + 8 * q[None, :, None, None, None]) < hi
        words = tl.load(vp.to(tl.pointer_type(tl.int32)) + woff, mask=wvalid, other=0)  # [BT, 2, NB, 4, 4]
        sw = tl.load(vs.to(tl.pointer_type(tl.int32)) + soff, mask=key0 < hi, other=0)  # [BT, NB, 4]: bytes (q, p)
    else:
        words = tl.load(vp.to(tl.pointer_type(tl.int32)) + woff)
        sw = tl.load(vs.to(tl.pointer_type(tl.int32)) + soff)
        hi = 1 << 30  # every key is in range (the masks below fold away)
    s00 = _tile_scales(sw, 0, key0 < hi, FAST, MASKED)
    s01 = _tile_scales(sw, 8, key0 + 1 < hi, FAST, MASKED)
    s10 = _tile_scales(sw, 16, key0 + 8 < hi, FAST, MASKED)
    s11 = _tile_scales(sw, 24, key0 + 9 < hi, FAST, MASKED)
    if FAST:  # bf16x2 scale pairs (p = 0 low, p = 1 high) per q
        s_lo = tl.permute(tl.join(s00 | (s01 << 16), s10 | (s11 << 16)), (0, 3, 1, 2))
        s_hi = s_lo
    else:
        s_lo = tl.permute(tl.join(s00, s10), (0, 3, 1, 2))
        s_hi = tl.permute(tl.join(s01, s11), (0, 3, 1, 2))
    s_lo = tl.broadcast_to(s_lo[:, :, :, :, None], (BT, 2, NB, 4, 4))
    if FAST:  # code * scale * 2^-7 in bf16, both keys of a pair from one word
        p0, p1, p2, p3 = _word_codes_times_scale(words, s_lo)
        lo, hi_key = _split_bf16x2(tl.reshape(tl.join(tl.join(p0, p2), tl.join(p1, p3)), (BT, 2, NB, 4, 4, 4)))
    else:  # code * scale in float32 from the same bits
        b0, b1, b2, b3 = word_pair_bits(words)
        bits = tl.reshape(tl.join(tl.join(b0, b2), tl.join(b1, b3)), (BT, 2, NB, 4, 4, 4))
        s_hi = tl.broadcast_to(s_hi[:, :, :, :, None], (BT, 2, NB, 4, 4))
        lo = (bits << 16).to(tl.float32, bitcast=True) * _POW2_126 * s_lo[:, :, :, :, :, None]
        hi_key = (bits >> 16 << 16).to(tl.float32, bitcast=True) * _POW2_126 * s_hi[:, :, :, :, :, None]
    v = tl.join(lo.to(DTYPE), hi_key.to(DTYPE))  # [BT, q, g, t, c, i, p]
    return tl.reshape(tl.permute(v, (5, 4, 2, 0, 1, 3, 6)), (DH, BLOCK_S))


@triton.jit
def value_tile_dims(DH: tl.constexpr):
    """Head dimension of each row of _value_tile_t's V^T: d = 16 g + 4 c + i for r = (4 i + c) * NB + g."""
    NB: tl.constexpr = DH // 16
    r = tl.arange(0, DH)
    return 16 * (r % NB) + 4 * (r // NB % 4) + r // (4 * NB)


@triton.jit
def _attend_block(q, m_i, l_i, acc, s0, hi, base, sm_scale, kp, ks, kg, vp, vs, vg, DH: tl.constexpr,
                  BLOCK_S: tl.constexpr, DTYPE: tl.constexpr, PREC: tl.constexpr, FAST: tl.constexpr,
                  WORDS: tl.constexpr, TILES: tl.constexpr, MASKED: tl.constexpr):
    """One online-softmax step over keys s0 .. s0 + BLOCK_S of the head whose cache rows start at base: (m, l, acc).
    MASKED: keys from hi on are left out (the last, partial block); otherwise every key is in range, and the
    block's loads and scores carry no masks (the loop's predicates and selects cost ~8% of its instructions).

    Keys are on the MMA's M side: scores^T = K q^T and out^T = V^T p^T. The dequantized key tile is then the register
    A operand and the G query heads of a kv head are the N side, which mma's n8 tiles take unpadded (G = 8: the
    q K^T form padded M to 16 rows, half its MMAs wasted, and was removed); sm_90 SASS of the 64-key loop, 2 warps:
    1351 -> 1065 instructions per thread, 207 -> 159 registers (tools/sass_report.py)."""
    js = s0 + tl.arange(0, BLOCK_S)
    valid = js < hi if MASKED else tl.full((BLOCK_S,), True, tl.int1)
    rows = base + js
    kt = dequant_tile(load_packed(kp, rows, DH // 2, 0, valid, DH, WORDS),
                      load_scales(ks, rows, DH // 16, 0, valid, DH, True),
                      BLOCK_S, DH, DTYPE, FAST, WORDS)
    gk = unscale(tl.load(kg + rows, mask=valid, other=0.0), FAST)
    scores = tl.trans(tl.dot(kt, tl.trans(q), input_precision=PREC))
    scores = scores * (gk * sm_scale)[None, :]
    if MASKED:
        scores = tl.where(valid[None, :], scores, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(scores, axis=1))
    alpha = tl.exp(m_i - m_new)
    p = tl.exp(scores - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    gv = unscale(tl.load(vg + rows, mask=valid, other=0.0), FAST)
    pv = (p * gv[None, :]).to(DTYPE)
    if TILES:  # V^T straight from the value tiles (rows in value_tile_dims order)
        vtt = _value_tile_t(vp, vs, base, s0, hi, DH, BLOCK_S, DTYPE, FAST, MASKED)
        acc = tl.trans(tl.dot(vtt, tl.trans(pv), tl.trans(acc * alpha[:, None]), input_precision=PREC))
    else:
        vt = dequant_tile(load_packed(vp, rows, DH // 2, 0, valid, DH, WORDS),
                          load_scales(vs, rows, DH // 16, 0, valid, DH, True),
                          BLOCK_S, DH, DTYPE, FAST, WORDS)
        acc = tl.trans(tl.dot(tl.trans(vt), tl.trans(pv), tl.trans(acc * alpha[:, None]), input_precision=PREC))
    return m_new, l_i, acc


@triton.jit
def _attn_split_kernel(q_ptr, pos_ptr, kp, ks, kg, vp, vs, vg, o_ptr, m_ptr, l_ptr, sm_scale,
                       T, H, S, SPLIT_LEN, NUM_SPLITS, G: tl.constexpr, DH: tl.constexpr,
                       BLOCK_G: tl.constexpr, BLOCK_S: tl.constexpr, DTYPE: tl.constexpr, PREC: tl.constexpr,
                       FAST: tl.constexpr, WORDS: tl.constexpr, TILES: tl.constexpr = False,
                       PDL: tl.constexpr = False):
    await_previous_grid(PDL)
    bht, split = tl.program_id(0), tl.program_id(1)  # bht = (b * H + h) * T + t
    t = bht % T
    bh = bht // T
    b = bh // H
    h = bh % H
    gi = tl.arange(0, BLOCK_G)
    d = tl.arange(0, DH)
    # q [B, H * G, T, DH]: query head h * G + gi
    q_rows = ((b * H * G + h * G + gi) * T + t) * DH
    q = tl.load(q_ptr + q_rows[:, None] + d[None, :], mask=gi[:, None] < G, other=0.0).to(DTYPE)
    length = tl.minimum(tl.load(pos_ptr + b * T + t) + 1, S)
    lo = split * SPLIT_LEN
    hi = tl.minimum(lo + SPLIT_LEN, length)
    m_i = tl.full((BLOCK_G,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_G,), tl.float32)
    acc = tl.zeros((BLOCK_G, DH), tl.float32)
    base = bh * S
    full_end = lo + (hi - lo) // BLOCK_S * BLOCK_S  # whole key blocks, then at most one partial block
    for s0 in range(lo, full_end, BLOCK_S):
        m_i, l_i, acc = _attend_block(q, m_i, l_i, acc, s0, hi, base, sm_scale, kp, ks, kg, vp, vs, vg, DH, BLOCK_S,
                                      DTYPE, PREC, FAST, WORDS, TILES, False)
    if full_end < hi:
        m_i, l_i, acc = _attend_block(q, m_i, l_i, acc, full_end, hi, base, sm_scale, kp, ks, kg, vp, vs, vg, DH,
                                      BLOCK_S, DTYPE, PREC, FAST, WORDS, TILES, True)
    part = (bht * NUM_SPLITS + split) * G + gi
    if TILES:
        d = value_tile_dims(DH)
    tl.store(o_ptr + part[:, None] * DH + d[None, :], acc, mask=gi[:, None] < G)
    tl.store(m_ptr + part, m_i, mask=gi < G)
    tl.store(l_ptr + part, l_i, mask=gi < G)


@triton.jit
def _attn_merge_kernel(o_ptr, m_ptr, l_ptr, out_ptr, T, H, NUM_SPLITS, G: tl.constexpr, DH: tl.constexpr,
                       BLOCK_SPLITS: tl.constexpr, PDL: tl.constexpr = False):
    await_previous_grid(PDL)
    bht, g = tl.program_id(0), tl.program_id(1)
    sp = tl.arange(0, BLOCK_SPLITS)
    d = tl.arange(0, DH)
    part = (bht * NUM_SPLITS + sp) * G + g
    ok = sp < NUM_SPLITS
    m = tl.load(m_ptr + part, mask=ok, other=float("-inf"))
    l_part = tl.load(l_ptr + part, mask=ok, other=0.0)
    o = tl.load(o_ptr + part[:, None] * DH + d[None, :], mask=ok[:, None], other=0.0)
    m_max = tl.max(m, axis=0)
    w = tl.where(m > float("-inf"), tl.exp(m - m_max), 0.0)
    den = tl.sum(w * l_part, axis=0)
    res = tl.sum(o * w[:, None], axis=0) / tl.where(den > 0, den, 1.0)
    t = bht % T
    bh = bht // T
    b = bh // H
    h = bh % H
    row = ((b * H * G + h * G + g) * T + t) * DH
    tl.store(out_ptr + row + d, res.to(out_ptr.dtype.element_ty))


_ATTN = tuned(_attn_split_kernel, [
    triton.Config({"BLOCK_S": bs}, num_warps=w, num_stages=st)
    for bs, w, st in ((32, 4, 2), (64, 4, 2), (64, 4, 3), (128, 4, 2), (128, 8, 2), (64, 8, 3))
], key=["T", "H", "S", "SPLIT_LEN", "NUM_SPLITS", "G", "DH"])


ATTN_LONG_KEYS = 2048  # keys per program from which KernelOptions.attention_long is used


def attention_splits(work: int, S: int, block_s: int, device: torch.device) -> int:
    """Splits of the key range for (B * Hkv * T) = `work` rows: the fewest that minimise rounds x (key blocks
    per program + 1), where a round is one wave of KernelOptions.attention_programs_per_sm programs per SM (the
    kernel's occupancy) and the + 1 is a program's fixed cost (q load, partial store, merge row). Filling the chip
    without a partial last wave matters: at B = 64 / 2K context, 3 splits gave 768 programs = 1.45 waves
    (ncu), so a second round of 11 blocks each; 2 splits is one round of 17."""
    return _best_splits(work, triton.cdiv(S, block_s), active_options().attention_programs_per_sm * sm_count(device))


def attention_shape(split_len: int) -> AttentionLaunch:
    """The launch shape (KernelOptions) for programs that each stream up to split_len keys."""
    options = active_options()
    if options.attention_long is not None and split_len >= ATTN_LONG_KEYS:
        return options.attention_long
    return options.attention


@functools.lru_cache(maxsize=256)
def _best_splits(work: int, blocks: int, wave: int) -> int:
    """attention_splits' search, cached: eager decode steps ask it once per layer with the same shape."""
    best: tuple[int, int] | None = None
    for splits in range(1, min(blocks, 64) + 1):
        per = triton.cdiv(blocks, splits)
        used = triton.cdiv(blocks, per)  # splits that hold keys at this split length
        key = (triton.cdiv(work * used, wave) * (per + 1), used)
        best = key if best is None or key < best else best
    return best[1]


def kv_attention(q: Tensor, layer: FP4KVLayer, q_positions: Tensor, sm_scale: float,
                 num_splits: int | None = None) -> Tensor:
    B, Hq, T, Dh = q.shape
    _, Hkv, S, _ = layer.shape
    if Hq % Hkv or q_positions.shape != (B, T) or Dh != layer.shape[3] or Dh & (Dh - 1):
        raise ValueError(f"q {tuple(q.shape)} / q_positions {tuple(q_positions.shape)} do not fit the cache "
                         f"{layer.shape} (head_dim must be a power of two)")
    G = Hq // Hkv
    fast = fast_dequant(q.dtype, q.device)
    if layer.words and not fast:  # only the fast decoder reads words: exact stored-order keys (and values) for the rest
        layer = layer.stored_keys() if layer.value_tiles else layer.stored_order()
    tune = autotune_on(q.device)
    unit = 128 if tune else active_options().attention.keys  # whole (autotuned) key blocks per split
    splits = num_splits or attention_splits(B * Hkv * T, S, unit, q.device)
    split_len = triton.cdiv(triton.cdiv(S, splits), unit) * unit
    shape = attention_shape(split_len)
    split_len = triton.cdiv(split_len, shape.keys) * shape.keys
    splits = triton.cdiv(S, split_len)
    work = B * Hkv * T
    o = torch.empty(work * splits * G, Dh, dtype=torch.float32, device=q.device)
    m = torch.empty(work * splits * G, dtype=torch.float32, device=q.device)
    l_sum = torch.empty_like(m)
    pos = q_positions.to(torch.int64).contiguous()
    args = (q.contiguous(), pos, layer.k_packed, scale_bytes(layer.k_scales), layer.k_global,
            layer.v_packed, scale_bytes(layer.v_scales), layer.v_global, o, m, l_sum, float(sm_scale),
            T, Hkv, S, split_len, splits, G, Dh, max(8, triton.next_power_of_2(G)))
    dt, prec = mma_dtype(q.dtype, q.device), dot_precision(q.dtype, q.device)
    pdl = grid_dependency(q.device)
    if tune:
        _ATTN[1][(work, splits)](*args, DTYPE=dt, PREC=prec, FAST=fast, WORDS=layer.words, TILES=layer.value_tiles,
                                 **pdl)
    else:
        _attn_split_kernel[(work, splits)](*args, BLOCK_S=shape.keys, DTYPE=dt, PREC=prec, FAST=fast,
                                           WORDS=layer.words, TILES=layer.value_tiles, num_warps=shape.warps,
                                           num_stages=shape.stages, **pdl)
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    _attn_merge_kernel[(work, G)](o, m, l_sum, out, T, Hkv, splits, G, Dh, triton.next_power_of_2(splits),
                                  num_warps=4, **pdl)
    return out


def fp4_kv_attention(q: Tensor, layer: FP4KVLayer, q_positions: Tensor, sm_scale: float) -> Tensor:
    """GQA attention of q [B, Hq, T, Dh] over cached keys j <= q_positions[b, t], reading the packed cache
    (Triton); a query with a negative position outputs zeros."""
    return kv_attention(q, layer, q_positions, sm_scale)
