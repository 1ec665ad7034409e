"""Triton NVFP4 / MXFP4 quantizers, byte-identical with trace_lightning.quant (and so torchao 0.18).

One program quantizes BLOCK_R rows, walking K in chunks held so that each thread has whole blocks
(block_offsets); the row-global variant first takes each row's amax in the same program (a row never
depends on its batch). The float32 op order is the reference's:
amax / 6, / global, clamp [2^-6, 448], E4M3 round, x * ((1 / global) / scale), E2M1 RNE.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from torch import Tensor

from trace_lightning.kernels._common import active_options, grid_dependency, sm_count
from trace_lightning.kernels._fp4 import (
    E2M1_CODE_BIAS,
    abs_bits_max,
    await_previous_grid,
    e2m1_magnitude,
    e4m3_round_byte,
    e4m3_to_f32,
    encode_e2m1,
    pack_codes,
    sign_eight,
    stored_words_to_word_layout,
    tile_offset,
)
from trace_lightning.quant import MXFP4, NVFP4, BlockFP4, FP4Format
from trace_lightning.quant import quantize_weight as _reference_quantize_weight
from trace_lightning.quant.mxfp4 import check_mx_mode
from trace_lightning.quant.nvfp4 import _check_global_scale
from trace_lightning.quant.words import TILE_BYTES, WordNVFP4

# Where the NVFP4 kernel's global scale comes from: none (1.0), given (a tensor or per-row one; weights), or computed
# per row in the same pass (activations, K / V). Constexpr constants rather than an enum: a jit function may read
# only tl.constexpr globals.
GLOBAL_NONE = tl.constexpr(0)
GLOBAL_GIVEN = tl.constexpr(1)
GLOBAL_ROW = tl.constexpr(2)
# What the NVFP4 kernel writes beside the bytes: nothing, the fake-quant value code * (scale * global) in x's dtype
# (NVFP4.dequantize's order), or a GEMM operand code * scale with the global left for the caller's epilogue.
DEQUANT_NONE = tl.constexpr(0)
DEQUANT_WITH_GLOBAL = tl.constexpr(1)
DEQUANT_NO_GLOBAL = tl.constexpr(2)
# E2M1_CODE_BIAS in each of a word's 8 nibbles, mod 2^32 as an int32
WORD_BIAS = tl.constexpr((E2M1_CODE_BIAS.value * 0x11111111 + 2**31) % 2**32 - 2**31)
_WORD_TILE = tl.constexpr(TILE_BYTES // 4)  # a tile row of packed codes, in int32 words
_SCALE_TILE = tl.constexpr(TILE_BYTES // 8)  # a tile row of scale bytes (one per 16 codes)


@triton.jit
def div_scalar(x, d: tl.constexpr):
    """x / d rounded once (IEEE), as the reference divides on every device (trace_lightning.quant.blocks.divide):
    never x * float32(1 / d), which is what torch itself does on CUDA for a Python divisor."""
    return tl.math.div_rn(x, tl.full(x.shape, d, tl.float32))


@triton.jit
def row_global(x_ptr, R, K, rows, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr):
    """Per-row global amax / 2688 floored at 2^-120 (NaN for a row holding NaN, inf for one holding inf), from a
    first pass over the row in the quantizing pass's tiles and block keys."""
    NB: tl.constexpr = BLOCK_K // 16
    amax_bits = tl.zeros((BLOCK_R,), tl.int32)
    for k0 in range(0, K, BLOCK_K):
        amax_bits = tl.maximum(amax_bits, tl.max(block_amax_bits(_load_blocks(x_ptr, rows, k0, R, K, 2, NB)), 0))
    return row_global_from_bits(amax_bits)


@triton.jit
def row_global_from_bits(amax_bits):
    """clamp(amax / (448 * 6), min=2^-120) from abs_bits_max's key; NaN where the row held NaN, inf kept."""
    amax = amax_bits.to(tl.float32, bitcast=True)
    g = tl.maximum(div_scalar(amax, 2688.0), 7.52316384526264e-37)  # 2^-120
    return tl.where(amax_bits > 0x7F800000, float("nan"), g)


@triton.jit
def nvfp4_block_scales(amax_bits, g, inv_g, HAS_GLOBAL: tl.constexpr):
    """Blocks' E4M3 scale bytes, 1 / (global * scale) and bad-block flags (NaN / inf in the block or its global) from
    abs_bits_max keys amax_bits and their row globals g, 1 / g (broadcast against amax_bits)."""
    bad = amax_bits >= 0x7F800000
    bs = div_scalar(amax_bits.to(tl.float32, bitcast=True), 6.0)
    if HAS_GLOBAL:
        bs = tl.math.div_rn(bs, tl.broadcast_to(g, bs.shape))
        bad = bad | ~(tl.abs(g) < float("inf"))
    byte = e4m3_round_byte(tl.minimum(tl.maximum(bs, 0.015625), 448.0))
    bad = bad | (bs != bs)
    byte = tl.where(bad, 0x7F, byte)
    s = e4m3_to_f32(byte)
    if HAS_GLOBAL:
        r = tl.math.div_rn(tl.broadcast_to(inv_g, s.shape), s)
    else:
        r = tl.math.div_rn(tl.full(s.shape, 1.0, tl.float32), s)
    return byte, r, bad


@triton.jit
def nvfp4_tile(x, g, inv_g, HAS_GLOBAL: tl.constexpr, BLOCK_R: tl.constexpr,
               BLOCK_K: tl.constexpr):
    """Quantize a float32 tile [BLOCK_R, BLOCK_K] with row globals g [BLOCK_R] (1/g given):
    -> (packed uint8 [BLOCK_R, BLOCK_K // 2], scale bytes int32 [BLOCK_R, BLOCK_K // 16])."""
    NB: tl.constexpr = BLOCK_K // 16
    xb = tl.reshape(x, (BLOCK_R, NB, 16))
    byte, r, _ = nvfp4_block_scales(abs_bits_max(xb, 2), g[:, None], inv_g[:, None], HAS_GLOBAL)
    codes = tl.reshape(encode_e2m1(xb * r[:, :, None]), (BLOCK_R, BLOCK_K))
    return pack_codes(codes, BLOCK_R, BLOCK_K), byte


@triton.jit
def block_offsets(rows, k0, K, PARTS: tl.constexpr, NB: tl.constexpr):
    """(element offsets, columns) [NB, BLOCK_R, PARTS, 8] into a row-major [R, K] tensor: part p of block b of
    row r is columns k0 + 8 PARTS b + 8 p .. + 8. Triton's blocked layout gives threads to the contiguous axis,
    then to the others in axis order: blocks, rows, parts. So the parts of a block are repeats in one thread,
    each 8 contiguous elements one 16-byte load, and a block's scale is computed once, by the thread that
    holds it, without shuffles (blocks as the second axis would split each over two threads)."""
    b = tl.arange(0, NB)[:, None, None, None]
    p = tl.arange(0, PARTS)[None, None, :, None]
    j = tl.arange(0, 8)[None, None, None, :]
    cols = k0 + b * (8 * PARTS) + p * 8 + j
    return rows[None, :, None, None].to(tl.int64) * K + cols, cols


@triton.jit
def block_amax_bits(x):
    """abs_bits_max's key of each block of a block_offsets tile [NB, BLOCK_R, PARTS, 8] -> [NB, BLOCK_R], from a
    float max of |x| (one compare an element, where the integer key also needs a mask an element) and a NaN probe,
    sum |x| * 2^-10 on the FP pipe: NaN exactly when a NaN is there (no inf - inf among magnitudes), finite for
    finite blocks (16 * 2^128 * 2^-10 < 2^128). The float max skips NaNs (or not, under the interpreter): the
    probe decides, and any key above inf's means NaN to every consumer."""
    ax = tl.abs(x)
    probe = tl.sum(tl.sum(ax * 0.0009765625, 3), 2)
    amax = tl.max(tl.max(ax, 3), 2)
    return tl.where(probe == probe, amax.to(tl.int32, bitcast=True), 0x7FC00000)


@triton.jit
def block_words(x, r, bad, NAN_SAFE: tl.constexpr, SATURATE: tl.constexpr = True):
    """(E2M1 code words int32 [NB, BLOCK_R, PARTS]: part p's 8 codes, element j in nibble j; the codes' signed
    values float32 [NB, BLOCK_R, PARTS, 8]) of a block_offsets tile x times its blocks' r [NB, BLOCK_R].
    Blocks flagged bad (NaN / inf in an NVFP4 block: r is NaN) are all 7s, as x * NaN encodes, at one select a
    word; with NAN_SAFE each element is checked instead (bad None): for an r that can overflow to inf (x = 0 then
    gives NaN) or MXFP4's r = 0 of a bad block (x / inf, whose NaNs are its inf and NaN elements). SATURATE False:
    for row-global NVFP4, where |x * r| < 7 in every good block: the block's amax / (6 g) is at most 448 there
    (g = amax_row / 2688), and its E4M3 scale is that rounded at most 1/16 low or clamped up to 2^-6, so
    |x * r| <= 6 / (1 - 1/16) = 6.4."""
    y = x * r[:, :, None, None]
    code, value = e2m1_magnitude(tl.abs(y), SATURATE)
    code = code + sign_eight(x)  # + E2M1_CODE_BIAS, taken off each word below
    if NAN_SAFE:
        code = tl.where(y != y, 7 + E2M1_CODE_BIAS, code)
    j = tl.arange(0, 8)[None, None, None, :]
    words = tl.sum(code << (4 * j), axis=3) - WORD_BIAS
    value = (value.to(tl.int32, bitcast=True) | (x.to(tl.int32, bitcast=True) & -0x80000000)).to(tl.float32,
                                                                                                  bitcast=True)
    if bad is not None:
        words = tl.where(bad[:, :, None], 0x77777777, words)
    return words, value


@triton.jit
def _nvfp4_chunk(x, k0, rows, g, inv_g, words_ptr, scales_ptr, dq_ptr, R, K, GLOBAL: tl.constexpr,
                 DEQUANT: tl.constexpr, NB: tl.constexpr, WORDS: tl.constexpr, TILED: tl.constexpr, amax_bits=None):
    """Quantize the loaded block_offsets tile x (float32, blocks k0 / 16 ..) of `rows` and store its bytes; amax_bits:
    its blocks' keys when the caller already has them. WORDS / TILED: the codes in the kernels' word layout, and
    codes and scales in their tiles (a GEMM weight as layout.prepare_weight holds it)."""
    if amax_bits is None:
        amax_bits = block_amax_bits(x)
    byte, r, bad = nvfp4_block_scales(amax_bits, g[None, :], inv_g[None, :], GLOBAL != GLOBAL_NONE)
    # a given global scale can make r overflow to inf (0 * inf is NaN, code 7): each element is checked then (a
    # branch on whether any r of the program overflows made the kernel 2.3x slower on an H200, 2026-12-04)
    words, value = block_words(x, r, None if GLOBAL == GLOBAL_GIVEN else bad, GLOBAL == GLOBAL_GIVEN,
                               GLOBAL != GLOBAL_ROW)
    _store_words(words_ptr, words, rows, k0, R, K, 2, NB, WORDS, TILED)
    nb = k0 // 16 + tl.arange(0, NB)
    tl.store(scales_ptr + tile_offset(rows[None, :].to(tl.int64), nb[:, None], K // 16, TILED, _SCALE_TILE),
             byte.to(tl.uint8), mask=(rows[None, :] < R) & (nb[:, None] < K // 16))
    if DEQUANT != DEQUANT_NONE:  # NVFP4.dequantize's order, value * (scale * global), then the cast (exact without)
        mult = e4m3_to_f32(byte)
        if DEQUANT == DEQUANT_WITH_GLOBAL:
            mult = mult * g[None, :]
        offs, cols = block_offsets(rows, k0, K, 2, NB)
        tl.store(dq_ptr + offs, (value * mult[:, :, None, None]).to(dq_ptr.dtype.element_ty),
                 mask=(rows[None, :, None, None] < R) & (cols < K))


@triton.jit
def _store_words(words_ptr, words, rows, k0, R, K, PARTS: tl.constexpr, NB: tl.constexpr,
                 WORDS: tl.constexpr = False, TILED: tl.constexpr = False):
    """block_words' words [NB, BLOCK_R, PARTS] into the packed bytes of [R, K] viewed as int32: row-major and in
    stored order, or in the kernels' word layout (WORDS) and tiles (TILED)."""
    word = k0 // 8 + tl.arange(0, NB)[:, None, None] * PARTS + tl.arange(0, PARTS)[None, None, :]
    if WORDS:
        words = stored_words_to_word_layout(words)
    tl.store(words_ptr + tile_offset(rows[None, :, None].to(tl.int64), word, K // 8, TILED, _WORD_TILE), words,
             mask=(rows[None, :, None] < R) & (word < K // 8))


@triton.jit
def _load_blocks(x_ptr, rows, k0, R, K, PARTS: tl.constexpr, NB: tl.constexpr):
    offs, cols = block_offsets(rows, k0, K, PARTS, NB)
    return tl.load(x_ptr + offs, mask=(rows[None, :, None, None] < R) & (cols < K), other=0.0).to(tl.float32)


@triton.jit
def _nvfp4_kernel(x_ptr, g_ptr, words_ptr, scales_ptr, dq_ptr, R, K, GLOBAL: tl.constexpr, DEQUANT: tl.constexpr,
                  ONE_PASS: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
                  WORDS: tl.constexpr = False, TILED: tl.constexpr = False, PDL: tl.constexpr = False):
    await_previous_grid(PDL)
    NB: tl.constexpr = BLOCK_K // 16
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    amax_bits = None
    if ONE_PASS:  # whole rows in one chunk: x is read once, the row amax (from the blocks' amaxes) included
        x = _load_blocks(x_ptr, rows, 0, R, K, 2, NB)
        amax_bits = block_amax_bits(x)
    if GLOBAL == GLOBAL_ROW:
        if ONE_PASS:
            g = row_global_from_bits(tl.max(amax_bits, 0))
        else:
            g = row_global(x_ptr, R, K, rows, BLOCK_R, BLOCK_K)
        tl.store(g_ptr + rows, g, mask=rows < R)
    else:
        g = tl.load(g_ptr + rows, mask=rows < R, other=1.0)
    inv_g = tl.math.div_rn(tl.full((BLOCK_R,), 1.0, tl.float32), g)
    if ONE_PASS:
        _nvfp4_chunk(x, 0, rows, g, inv_g, words_ptr, scales_ptr, dq_ptr, R, K, GLOBAL, DEQUANT, NB, WORDS, TILED,
                     amax_bits)
    else:
        for k0 in range(0, K, BLOCK_K):
            _nvfp4_chunk(_load_blocks(x_ptr, rows, k0, R, K, 2, NB), k0, rows, g, inv_g, words_ptr, scales_ptr,
                         dq_ptr, R, K, GLOBAL, DEQUANT, NB, WORDS, TILED)


@triton.jit
def _rceil_exponent(v):
    """ceil(log2(v)) for float32 v >= 0 as torch computes it (correctly rounded log2, then ceil), int32."""
    vb = v.to(tl.int32, bitcast=True)
    field = vb >> 23
    mant = vb & 0x7FFFFF
    e = field - 127
    a = tl.abs(e)
    fl = (a >= 2).to(tl.int32) + (a >= 4).to(tl.int32) + (a >= 8).to(tl.int32) + (a >= 16).to(tl.int32)
    fl += (a >= 32).to(tl.int32) + (a >= 64).to(tl.int32)
    pow2 = (a & (a - 1)) == 0
    t = tl.where(e > 0, fl - 1, fl - 1 - pow2.to(tl.int32))  # half an ulp of e + log2(1+f) is 2^(t-23)
    limit = tl.where(t == 1, 1, tl.where(t == 2, 2, tl.where(t == 3, 5, tl.where(t == 4, 11, tl.where(t >= 5, 22, 0)))))
    limit = tl.where((e == 0) | (e == -1), 0, limit)  # floor(2^t * ln 2): log2 rounds back to e below it
    normal = tl.where((mant == 0) | (mant <= limit), e, e + 1)
    sub = tl.where(vb - 0x400000 > 11, -126, -127)  # subnormal v (and 0): only -127 or -126 survive the clamp
    return tl.where(field == 0, sub, normal)


@triton.jit
def _mxfp4_kernel(x_ptr, words_ptr, scales_ptr, R, K, RCEIL: tl.constexpr,
                  BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr = False):
    await_previous_grid(PDL)
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    NB: tl.constexpr = BLOCK_K // 32
    for k0 in range(0, K, BLOCK_K):
        x = _load_blocks(x_ptr, rows, k0, R, K, 4, NB)
        amax_bits = block_amax_bits(x)
        bad = amax_bits >= 0x7F800000  # NaN or inf in the block (whose scale byte then is 255)
        amax = amax_bits.to(tl.float32, bitcast=True)
        if RCEIL:
            exp = tl.minimum(tl.maximum(_rceil_exponent(div_scalar(amax, 6.0)), -127), 127)
            biased = tl.where(bad, 255, exp + 127)
            rb = ((254 - biased) << 23).to(tl.float32, bitcast=True)
            r = tl.where(biased == 0, 1.0, tl.where(biased == 254, 5.877471754111438e-39, rb))  # 2^-127
            r = tl.where(biased == 255, float("nan"), r)
        else:
            exp = (amax_bits >> 23) - 129
            biased = tl.where(bad, 255, tl.minimum(tl.maximum(exp, -127), 128) + 127)
            r = ((254 - tl.maximum(biased, 1)) << 23).to(tl.float32, bitcast=True)  # 1 / max(scale, 2^-126)
            r = tl.where(biased == 255, 0.0, r)  # x / inf
        words, _ = block_words(x, r, None, True)
        _store_words(words_ptr, words, rows, k0, R, K, 4, NB)
        nb = k0 // 32 + tl.arange(0, NB)
        tl.store(scales_ptr + rows[None, :].to(tl.int64) * (K // 32) + nb[:, None], biased.to(tl.uint8),
                 mask=(rows[None, :] < R) & (nb[:, None] < K // 32))


@triton.jit
def _parity_kernel(packed_ptr, out_ptr, n_out, BLOCK: tl.constexpr, PDL: tl.constexpr = False):
    await_previous_grid(PDL)
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    quad = tl.arange(0, 4)
    p = tl.load(packed_ptr + offs[:, None] * 4 + quad[None, :], mask=offs[:, None] < n_out, other=0).to(tl.int32)
    bits = ((p & 1) | (((p >> 4) & 1) << 1)) << (2 * quad[None, :])
    tl.store(out_ptr + offs, tl.sum(bits, axis=1).to(tl.uint8), mask=offs < n_out)


def _rows_view(x: Tensor, block: int) -> Tensor:
    if not isinstance(x, Tensor) or x.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"input must be a float32/bfloat16/float16 tensor, got {getattr(x, 'dtype', type(x))}")
    if x.dim() == 0 or x.shape[-1] % block:
        raise ValueError(f"last dim of shape {tuple(x.shape)} must be divisible by the block size {block}")
    return x.reshape(-1, x.shape[-1]).contiguous()


def _launch_shape(R: int, K: int, device: torch.device, per_thread: int = 64) -> tuple[int, int, int]:
    """(BLOCK_R, BLOCK_K, warps): whole rows up to 8192 wide (one pass: the row-global mode would otherwise
    read each row twice), about per_thread elements a thread, and few enough rows per program that a
    decode-sized activation ([64, 2048]) still spreads over the chip instead of 4 programs walking it.
    H200 (tools/sweep_quant.py, 2026-12-04), one row of 8192 a program: 64 elements a thread for
    the quantizers (NVFP4 rows 59 -> 74% of the copy ceiling against 32), 32 for those that also write the
    dequantized values (67% against 45%)."""
    block_k = triton.next_power_of_2(K) if K <= 8192 else 256
    block_r = max(1, min(4096 // block_k, triton.next_power_of_2(R)))
    while block_r > 1 and triton.cdiv(R, block_r) < 2 * sm_count(device):
        block_r //= 2
    launch = active_options().quantize
    if launch is not None:
        return launch.rows, block_k, launch.warps
    return block_r, block_k, max(4, block_r * block_k // (32 * per_thread))


def _nvfp4(x: Tensor, g: Tensor | None, global_scale: tl.constexpr, dq: Tensor | None = None,
           dequant: tl.constexpr = DEQUANT_WITH_GLOBAL, word_layout: bool = False,
           tiled: bool = False) -> tuple[Tensor, Tensor, Tensor]:
    """(packed, scales, row globals) of x; with dq given, also the `dequant` values into dq (x's shape); `word_layout`
    / `tiled`: packed in the kernels' word layout, packed and scales in their tiles (quantize_nvfp4)."""
    x2 = _rows_view(x, 16)
    R, K = x2.shape
    packed = torch.empty(R, K // 2, dtype=torch.uint8, device=x.device)
    scales = torch.empty(R, K // 16, dtype=torch.uint8, device=x.device)
    g_rows = torch.empty(R, dtype=torch.float32, device=x.device) if g is None else g
    block_r, block_k, warps = _launch_shape(R, K, x.device, 64 if dq is None else 32)
    dequant = DEQUANT_NONE if dq is None else dequant
    words = packed.view(torch.int32)  # the kernel stores 8 codes a word
    _nvfp4_kernel[(triton.cdiv(R, block_r),)](x2, g_rows, words, scales, packed if dq is None else dq, R, K,
                                              global_scale.value, dequant.value, block_k >= K, block_r, block_k,
                                              word_layout, tiled, num_warps=warps, **grid_dependency(x.device))
    lead = tuple(x.shape[:-1])
    return packed.view(*lead, K // 2), scales.view(*lead, K // 16).view(torch.float8_e4m3fn), g_rows


def quantize_nvfp4(x: Tensor, global_scale: Tensor | float | None = None, *, word_layout: bool = False,
                   tiled: bool = False) -> NVFP4:
    """NVFP4 of x [..., K] with no, a scalar, or a broadcastable [..., 1] global scale (Triton). `word_layout` (K
    divisible by 8) and `tiled` (also rows and K / 2 whole tiles: quant.words.tileable): a WordNVFP4 written so by
    the same launch, byte for byte what WordNVFP4.from_stored makes of the stored bytes."""
    if tiled and not word_layout:
        raise ValueError("tiled NVFP4 codes exist only in the word layout (WordNVFP4)")
    g = _check_global_scale(global_scale, x)
    rows = None if g is None else torch.broadcast_to(g, (*x.shape[:-1], 1)).reshape(-1).contiguous()
    packed, scales, _ = _nvfp4(x, rows if rows is not None else torch.ones(1, device=x.device),
                               GLOBAL_NONE if g is None else GLOBAL_GIVEN, word_layout=word_layout, tiled=tiled)
    if word_layout:
        return WordNVFP4(packed=packed, scales=scales, global_scale=g, tiled=tiled)
    return NVFP4(packed=packed, scales=scales, global_scale=g)


def quantize_weight(w: Tensor, fmt: FP4Format | str, *, word_layout: bool = False, tiled: bool = False) -> BlockFP4:
    """trace_lightning.quant.quantize_weight with the codes and block scales from one kernel launch (its global
    scale rule is the reference's own; tests/kernels/test_one_definition.py: byte for byte), NVFP4 optionally
    written in the GEMMs' layout (quantize_nvfp4; layout.prepared_weight decides). A weight sync re-quantizes every
    FP4 weight each RL step; the reference's ~65 torch ops a tensor made small-moe's sync launch-bound (65 ms on an
    H200)."""
    return _reference_quantize_weight(w, fmt, nvfp4=functools.partial(quantize_nvfp4, word_layout=word_layout,
                                                                       tiled=tiled))


def quantize_nvfp4_rows(x: Tensor) -> NVFP4:
    """NVFP4 with the per-row global scale computed in the same pass (activations, K/V) (Triton)."""
    packed, scales, g = _nvfp4(x, None, GLOBAL_ROW)
    return NVFP4(packed=packed, scales=scales, global_scale=g.view(*x.shape[:-1], 1))


def fake_quantize_nvfp4_rows(x: Tensor) -> tuple[Tensor, NVFP4]:
    """(dequantized x in x's dtype, its row-global NVFP4) from one pass: an activation site's value and record."""
    dq = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    packed, scales, g = _nvfp4(x, None, GLOBAL_ROW, dq)
    return dq, NVFP4(packed=packed, scales=scales, global_scale=g.view(*x.shape[:-1], 1))


def quantize_nvfp4_rows_operand(x: Tensor, dtype: torch.dtype) -> tuple[NVFP4, Tensor]:
    """(quantize_nvfp4_rows(x), code * block scale in dtype) from one pass: the record and a GEMM operand.

    A GEMM consuming the NVFP4 then loads the operand as a plain tile instead of decoding bytes in its K loop
    (in every one of its column programs), and multiplies the row global into its float32 accumulator. The
    operand is exact in bf16 / fp16: an E2M1 code (<= 2 significant bits) times an E4M3 scale (<= 4), within
    [2^-10, 2688]; so the GEMM's products are those of the dequantize-in-the-loop form."""
    operand = torch.empty(x.shape, dtype=dtype, device=x.device)
    packed, scales, g = _nvfp4(x, None, GLOBAL_ROW, operand, DEQUANT_NO_GLOBAL)
    return NVFP4(packed=packed, scales=scales, global_scale=g.view(*x.shape[:-1], 1)), operand


def quantize_mxfp4(x: Tensor, mode: str = "floor") -> MXFP4:
    """MXFP4 of x [..., K] with the FLOOR or RCEIL scale rule (Triton)."""
    check_mx_mode(mode)
    x2 = _rows_view(x, 32)
    R, K = x2.shape
    packed = torch.empty(R, K // 2, dtype=torch.uint8, device=x.device)
    scales = torch.empty(R, K // 32, dtype=torch.uint8, device=x.device)
    block_r, block_k, warps = _launch_shape(R, K, x.device)
    _mxfp4_kernel[(triton.cdiv(R, block_r),)](x2, packed.view(torch.int32), scales, R, K, mode == "rceil",
                                              block_r, block_k, num_warps=warps, **grid_dependency(x.device))
    lead = tuple(x.shape[:-1])
    return MXFP4(packed=packed.view(*lead, K // 2), scales=scales.view(*lead, K // 32).view(torch.float8_e8m0fnu),
                 mode=mode)


def pack_parity(packed: Tensor) -> Tensor:
    """Parity bits of packed codes [..., K/2] -> uint8 [..., K/8]; bit i of byte j is code 8j + i (Triton)."""
    if packed.dtype != torch.uint8 or packed.shape[-1] % 4:
        raise ValueError(f"packed must be uint8 with a last dim divisible by 4, got {packed.dtype} {packed.shape}")
    src = packed.contiguous()
    out = torch.empty(*packed.shape[:-1], packed.shape[-1] // 4, dtype=torch.uint8, device=packed.device)
    n = out.numel()
    _parity_kernel[(triton.cdiv(n, 1024),)](src, out, n, 1024, num_warps=4, **grid_dependency(packed.device))
    return out
