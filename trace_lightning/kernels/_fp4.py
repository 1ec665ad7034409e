"""Triton device helpers shared by the FP4 kernels: bit-exact E2M1 / E4M3 / E8M0 arithmetic.

Everything that decides a byte is done with integer bit operations or IEEE-rounded float32 ops
(`div_rn`, plain multiplies), never with approximate hardware conversions, so the bytes equal the
torch reference on GPU and under TRITON_INTERPRET=1 alike, on Triton 3.6 and 3.9.
"""

from __future__ import annotations

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_wait

from trace_lightning.quant.words import TILE_BYTES, TILE_ROWS


@triton.jit
def await_previous_grid(PDL: tl.constexpr):
    """With programmatic dependent launch (`_common.grid_dependency`): wait until the previous kernel in the stream
    has finished and its writes are visible. Every kernel calls this before its first load or store, so a kernel
    started early never reads inputs, or overwrites buffers, that the one before it is still using; the next kernel
    may launch as this one's programs exit. A no-op without PDL (and under the CPU interpreter, which never sets it)."""
    if PDL:
        gdc_wait()


@triton.jit
def abs_bits_max(x, axis: tl.constexpr):
    """max |x| along axis as int32 bits of float32 x: an order-preserving key (NaN's bits lie above inf's),
    so one integer max gives both the amax and whether a NaN was there, where a NaN-ignoring float max
    needs a select and a second reduction per element."""
    return tl.max(x.to(tl.int32, bitcast=True) & 0x7FFFFFFF, axis=axis)


# 1.5 * 2^22 + 1: a float32 this size has a 0.5 ulp, E2M1's step below 2 (its bits end in 2, so that adding
# 1.0's bits >> 22, 254, gives E2M1_CODE_BIAS + the code: a constant a caller can take off a whole word of codes)
_E2M1_FIXED = tl.constexpr(6291457.0)
E2M1_CODE_BIAS = tl.constexpr(0x4AC00100)


@triton.jit
def e2m1_magnitude(t, SATURATE: tl.constexpr = True):
    """(int32 E2M1_CODE_BIAS + E2M1 magnitude code 0..7, the code's value float32) of float32 t >= 0 or inf: RNE,
    saturating at 6 (SATURATE False: for callers whose t is below 7, which then rounds to at most 6 anyway).

    Float32 rounding does the work, on the FP pipe (sm_90 issues integer and compare ops at half the FP rate,
    and the quantizers are bound by them): min(t, 1) + 1.5 * 2^22 rounds to a multiple of 0.5, E2M1's
    subnormal step, and reads off as 0 / 1 / 2 in the low bits; clamp(t, 1, 6) rounded to two significant
    bits by Veltkamp's split (t * (2^22 + 1), written so that a fused multiply-add rounds it the same) is
    E2M1's normal range, whose code is its exponent and top mantissa bit. Each part is exact where the other
    is clamped, so the codes add. NaN is the caller's to handle."""
    below = tl.minimum(t, 1.0) + _E2M1_FIXED
    above = tl.maximum(t, 1.0)
    if SATURATE:
        above = tl.minimum(above, 6.0)
    gamma = above * 4194304.0 + above
    rounded = gamma + (above - gamma)
    code = below.to(tl.int32, bitcast=True) + (rounded.to(tl.int32, bitcast=True) >> 22)
    return code, (below - _E2M1_FIXED) + (rounded - 1.0)


@triton.jit
def sign_eight(x):
    """int32 8 where float32 x's sign bit is set (-0 included), else 0: the sign bit of an E2M1 code. Written as a
    high-word multiply of the masked sign, which ptxas turns into a shift folded into the add that takes it
    (sm_90: LOP3 + LEA.HI an element, against a shift, a mask and an OR)."""
    return tl.umulhi(x.to(tl.int32, bitcast=True) & -0x80000000, 16)


@triton.jit
def encode_e2m1(y):
    """E2M1 codes (int32 0..15) of float32 y: RNE, saturating, -0 keeps its sign, NaN -> 7 (the sim's rule)."""
    code, _ = e2m1_magnitude(tl.abs(y))
    code = code - E2M1_CODE_BIAS + sign_eight(y)
    return tl.where((y.to(tl.int32, bitcast=True) & 0x7FFFFFFF) > 0x7F800000, 7, code)


@triton.jit
def e4m3_round_byte(c):
    """E4M3 byte of float32 c in [2^-6, 448] (normal range: the quantizer clamps first), round to nearest even."""
    b = c.to(tl.int32, bitcast=True)
    r = (b + 0x7FFFF + ((b >> 20) & 1)) & ~0xFFFFF
    return (((r >> 23) - 120) << 3) | ((r >> 20) & 7)


@triton.jit
def e4m3_to_f32(byte):
    """float32 value of E4M3 bytes (int32 0..255): normals, subnormals, NaN for 0x7F / 0xFF."""
    e = (byte >> 3) & 15
    m = byte & 7
    normal = (((e + 120) << 23) | (m << 20)).to(tl.float32, bitcast=True)
    v = tl.where(e == 0, m.to(tl.float32) * 0.001953125, normal)  # subnormal: m * 2^-9
    v = tl.where((byte & 0x7F) == 0x7F, float("nan"), v)
    return tl.where((byte & 0x80) != 0, -v, v)


@triton.jit
def e2m1_to_f16_scaled(code):
    """fp16 holding E2M1 value * 2^-14 (the code's bits shifted into fp16; exact, subnormals included)."""
    bits = ((code & 7) << 9) | ((code & 8) << 12)
    return bits.to(tl.int16).to(tl.float16, bitcast=True)


@triton.jit
def unpack_codes(packed, ROWS: tl.constexpr, COLS: tl.constexpr):
    """uint8 [ROWS, COLS // 2] bytes -> int32 codes [ROWS, COLS], the even index in the low nibble."""
    p = packed.to(tl.int32)
    return tl.reshape(tl.join(p & 15, p >> 4), (ROWS, COLS))


@triton.jit
def pack_codes(codes, ROWS: tl.constexpr, COLS: tl.constexpr):
    """int32 codes [ROWS, COLS] -> uint8 bytes [ROWS, COLS // 2]."""
    lo, hi = tl.split(tl.reshape(codes, (ROWS, COLS // 2, 2)))
    return (lo | (hi << 4)).to(tl.uint8)


@triton.jit
def dequant_tile_exact(packed, scale_bytes, ROWS: tl.constexpr, COLS: tl.constexpr, DTYPE: tl.constexpr):
    """NVFP4 tile -> code * block scale in DTYPE (exact in bf16: <= 6 significant bits); global scale left out.

    Portable (any DTYPE, runs under the CPU interpreter) but ~15 instructions per weight on sm_90."""
    v = e2m1_to_f16_scaled(unpack_codes(packed, ROWS, COLS)).to(tl.float32)
    s = e4m3_to_f32(scale_bytes.to(tl.int32)) * 16384.0  # undo the 2^-14 of the fp16 trick (exact)
    s = tl.reshape(tl.broadcast_to(s[:, :, None], (ROWS, COLS // 16, 16)), (ROWS, COLS))
    return (v * s).to(DTYPE)


_POW2_119 = tl.constexpr(2.0**119)  # keeps code * scale * 2^-7 inside bf16's normal range ([2^-17, 21])


@triton.jit
def _codes_times_scale(byte, scale_pair):
    """(lo, hi) bf16 of one packed byte: both E2M1 codes times the bf16 scale pair, in five instructions.

    b * 0x40040 puts the two nibbles' magnitude bits at bf16 bits 6-8 of each half, b * 0x1001000 their
    signs at bits 15 / 31 (each product's two shifted copies never overlap, so no carries); masked and
    merged, that is a bf16 pair holding code * 2^-126 (0.5 is a bf16 subnormal, which bf16 multiplies
    keep). One bf16x2 multiply by scale * 2^119 gives code * scale * 2^-7 exactly (<= 6 significant bits,
    normal range)."""
    return tl.inline_asm_elementwise(
        """{
        .reg .b32 t0, t1;
        mul.lo.u32 t0, $2, 0x40040;
        mul.lo.u32 t1, $2, 0x1001000;
        and.b32 t1, t1, 0x80008000;
        lop3.b32 t0, t0, 0x01C001C0, t1, 0xEA;
        mul.rn.bf16x2 t0, t0, $3;
        mov.b32 {$0, $1}, t0;
        }""",
        "=h,=h,r,r", [byte, scale_pair], dtype=(tl.bfloat16, tl.bfloat16), is_pure=True, pack=1)


@triton.jit
def _word_codes_times_scale(word, scale_pair):
    """The four int32 bf16x2 (c[2i], c[2i + 1]) * scale pair, i = 0..3, of int32 words in the kernels' word
    layout (trace_lightning/quant/words.py): 9 bit instructions and 4 bf16x2 multiplies per 4 bytes, against ~24 for
    `_codes_times_scale` on stored bytes (which also has to isolate each byte first)."""
    return tl.inline_asm_elementwise(
        """{
        .reg .b32 t, u;
        and.b32 t, $4, 0x81C081C0;
        mul.rn.bf16x2 $0, t, $5;
        shf.r.wrap.b32 t, $4, $4, 4;
        and.b32 t, t, 0x81C081C0;
        mul.rn.bf16x2 $1, t, $5;
        shf.r.wrap.b32 t, $4, $4, 10;
        and.b32 t, t, 0x81C081C0;
        mul.rn.bf16x2 $2, t, $5;
        shf.l.wrap.b32 t, $4, $4, 2;
        shf.l.wrap.b32 u, $4, $4, 10;
        and.b32 t, t, 0x00400040;
        and.b32 u, u, 0x81808180;
        or.b32 t, t, u;
        mul.rn.bf16x2 $3, t, $5;
        }""",
        "=r,=r,=r,=r,r,r", [word, scale_pair], dtype=(tl.int32, tl.int32, tl.int32, tl.int32), is_pure=True,
        pack=1)


@triton.jit
def word_pair_bits(words):
    """_word_codes_times_scale without its multiplies, in portable Triton ops: the four masked bit patterns of int32
    words in the word layout (pair i = the bf16x2 bits of c[2i] * 2^-126, c[2i + 1] * 2^-126)."""
    w = words.to(tl.uint32, bitcast=True)
    m = 0x81C081C0
    return (w & m, _rotl(w, 28) & m, _rotl(w, 22) & m, (_rotl(w, 2) & 0x00400040) | (_rotl(w, 10) & 0x81808180))


@triton.jit
def scale_bf16_bits(scale_bytes):
    """int32 0..0xFFFF: the bf16 bits of E4M3 scale bytes (uint8) times 2^119, one half of the word decoders' scale
    pair (a NaN byte stays NaN)."""
    s = scale_bytes.to(tl.float8e4nv, bitcast=True).to(tl.float32) * _POW2_119
    return s.to(tl.bfloat16).to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF


@triton.jit
def _split_bf16x2(pair):
    """(lo, hi) bf16 halves of int32 bf16x2 values: a register view, no instruction."""
    return tl.inline_asm_elementwise("mov.b32 {$0, $1}, $2;", "=h,=h,r", [pair],
                                     dtype=(tl.bfloat16, tl.bfloat16), is_pure=True, pack=1)


@triton.jit
def _dequant_pairs_bf16(packed, scale_bytes, ROWS: tl.constexpr, COLS: tl.constexpr, WORDS: tl.constexpr = False):
    """(lo, hi) bf16 [ROWS, COLS // 2]: each packed byte's two codes times its block scale times 2^-7.

    WORDS: `packed` is int32 [ROWS, COLS // 8], words in the kernels' word layout (loaded as int32 so that
    each word's 4 bytes are one register whatever layout the compiler picks for the tile)."""
    half = scale_bf16_bits(scale_bytes)
    PER_BLOCK: tl.constexpr = 2 if WORDS else 8  # packed elements per 16-code block: words or bytes
    pair = tl.reshape(tl.broadcast_to((half | (half << 16))[:, :, None], (ROWS, COLS // 16, PER_BLOCK)),
                      (ROWS, COLS // 16 * PER_BLOCK))
    if WORDS:
        p0, p1, p2, p3 = _word_codes_times_scale(packed, pair)
        return _split_bf16x2(tl.reshape(tl.join(tl.join(p0, p2), tl.join(p1, p3)), (ROWS, COLS // 2)))
    else:
        return _codes_times_scale(packed.to(tl.int32), pair)


@triton.jit
def dequant_tile_bf16(packed, scale_bytes, ROWS: tl.constexpr, COLS: tl.constexpr, WORDS: tl.constexpr = False):
    """NVFP4 tile -> bf16 code * block scale * 2^-7 (exact) with packed bf16x2 arithmetic (CUDA only).

    ~7 instructions per weight instead of ~15: the hot loop of every W4A16 GEMM here is dequantization."""
    lo, hi = _dequant_pairs_bf16(packed, scale_bytes, ROWS, COLS, WORDS)
    return tl.reshape(tl.join(lo, hi), (ROWS, COLS))


@triton.jit
def _permute_pairs(t, ROWS: tl.constexpr, COLS: tl.constexpr):
    """permute_k on per-byte values [ROWS, COLS // 2] (byte p holds columns 2p and 2p + 1)."""
    return tl.reshape(tl.permute(tl.reshape(t, (ROWS, 4, COLS // 8)), (0, 2, 1)), (ROWS, COLS // 2))


@triton.jit
def permute_k(x, ROWS: tl.constexpr, COLS: tl.constexpr):
    """The column order the GEMMs contract a K tile in: column pair 4j + t is stored pair (COLS / 8) t + j.

    A sum over K does not care about order, so both operands go through this and the product is unchanged.
    On the weight side it is what makes the load cheap: a Hopper MMA fragment holds column pairs t, t + 4,
    t + 8, ... (t = lane % 4), which are then COLS / 8 contiguous packed bytes under one block scale, so a
    thread reads them with one wide shared-memory load and converts one scale instead of one byte and one
    scale per pair (sm_90 SASS: 233 -> 184 instructions per 64-wide K tile, tools/sass_report.py)."""
    return tl.reshape(tl.permute(tl.reshape(x, (ROWS, 4, COLS // 8, 2)), (0, 2, 1, 3)), (ROWS, COLS))


@triton.jit
def dequant_tile_kperm(packed, scale_bytes, ROWS: tl.constexpr, COLS: tl.constexpr, DTYPE: tl.constexpr,
                       FAST: tl.constexpr, WORDS: tl.constexpr = False):
    """permute_k(dequant_tile(...)): the weight operand of a K contraction whose other operand is permuted too.

    The fast path dequantizes in stored order and permutes the results, so each thread's bytes and scale
    stay contiguous; the portable path permutes the dequantized tile. WORDS (fast path only, which
    layout.readable_weight ensures): `packed` is int32 words in the kernels' word layout (load_packed)."""
    if FAST:
        lo, hi = _dequant_pairs_bf16(packed, scale_bytes, ROWS, COLS, WORDS)
        return tl.reshape(tl.join(_permute_pairs(lo, ROWS, COLS), _permute_pairs(hi, ROWS, COLS)), (ROWS, COLS))
    else:
        return permute_k(dequant_tile_exact(packed, scale_bytes, ROWS, COLS, DTYPE), ROWS, COLS)


@triton.jit
def weight_tile_kperm(w_ptr, s_ptr, rows, K, k0, rmask, ROWS: tl.constexpr, COLS: tl.constexpr, DTYPE: tl.constexpr,
                      FAST: tl.constexpr, WORDS: tl.constexpr, TILED: tl.constexpr, EVEN_K: tl.constexpr):
    """The GEMMs' weight operand: rows' K step k0 of an NVFP4 matrix of K columns (words / tiles as the weight is
    held), decoded in registers to code * block scale [ROWS, COLS] in permute_k order (see dequant_tile_kperm)."""
    return dequant_tile_kperm(load_packed(w_ptr, rows, K // 2, k0, rmask, COLS, WORDS, TILED, EVEN_K),
                              load_scales(s_ptr, rows, K // 16, k0, rmask, COLS, EVEN_K, TILED),
                              ROWS, COLS, DTYPE, FAST, WORDS)


@triton.jit
def activation_tile_kperm(ptr, rows, K, k0, rmask, ROWS: tl.constexpr, COLS: tl.constexpr, DTYPE: tl.constexpr,
                          EVEN_K: tl.constexpr):
    """The GEMMs' other operand: rows' K step k0 of a row-major [.., K] tensor in DTYPE, in permute_k order."""
    rk = k0 + tl.arange(0, COLS)
    mask = rmask[:, None] if EVEN_K else rmask[:, None] & (rk[None, :] < K)
    return permute_k(tl.load(ptr + rows[:, None] * K + rk[None, :], mask=mask, other=0.0).to(DTYPE), ROWS, COLS)


@triton.jit
def dequant_tile(packed, scale_bytes, ROWS: tl.constexpr, COLS: tl.constexpr, DTYPE: tl.constexpr,
                 FAST: tl.constexpr, WORDS: tl.constexpr = False):
    """code * block scale in DTYPE, times 2^-7 when FAST (bf16 on CUDA): callers pass their float32 result
    through `unscale`. WORDS (FAST only): `packed` is int32 words in the word layout (load_packed)."""
    if FAST:
        return dequant_tile_bf16(packed, scale_bytes, ROWS, COLS, WORDS)
    else:
        return dequant_tile_exact(packed, scale_bytes, ROWS, COLS, DTYPE)


@triton.jit
def unscale(x, FAST: tl.constexpr):
    """Undo dequant_tile's 2^-7 (exact: a power of two) on a float32 scale or accumulator."""
    if FAST:
        return x * 128.0
    else:
        return x


_TILE_ROWS = tl.constexpr(TILE_ROWS)
_TILE_BYTES = tl.constexpr(TILE_BYTES)


@triton.jit
def tile_offsets(rows, cols, row_units, TILED: tl.constexpr, TILE_COLS: tl.constexpr):
    """Offsets of [rows, cols] in a matrix of row_units units a row: row-major, or (TILED) in tiles of _TILE_ROWS x
    TILE_COLS units, each contiguous and row-major (trace_lightning/quant/words.py). Tiles never straddle the
    matrices of a stack (their rows are a multiple of _TILE_ROWS), so rows may count across them."""
    return tile_offset(rows[:, None], cols[None, :], row_units, TILED, TILE_COLS)


@triton.jit
def tile_offset(row, col, row_units, TILED: tl.constexpr, TILE_COLS: tl.constexpr):
    """tile_offsets elementwise: the offset of (row, col), broadcast against each other (the row's part and the
    column's part are each computed at their own shape, then added)."""
    if TILED:
        TILE: tl.constexpr = _TILE_ROWS * TILE_COLS
        row_part = row // _TILE_ROWS * (row_units // TILE_COLS * TILE) + row % _TILE_ROWS * TILE_COLS
        return row_part + (col // TILE_COLS * TILE + col % TILE_COLS)
    else:
        return row * row_units + col


@triton.jit
def load_packed(ptr, rows, row_bytes, k0, rmask, COLS: tl.constexpr, WORDS: tl.constexpr, TILED: tl.constexpr = False,
                EVEN_K: tl.constexpr = False):
    """The packed tile of a K tile starting at column k0: uint8 [len(rows), COLS // 2] of rows (row_bytes bytes
    each), or with WORDS int32 [len(rows), COLS // 8] words (row_bytes divisible by 4: layout.prepare_weight);
    TILED: the matrix is in the kernels' tiles.

    EVEN_K (the K extent and k0 are multiples of COLS): no column mask, and k0 written as a visible multiple of
    COLS. The mask `column < row end` is constant only over as many columns as Triton can prove row_bytes
    divisible by, and a split-K start only as aligned as its specialization says, which held the word loads to 8
    bytes (sm_90 SASS: LDGSTS.E.64) where the unmasked, aligned load is 16 bytes (LDGSTS.E.BYPASS.128)."""
    if EVEN_K:
        k0 = k0 // COLS * COLS  # the same value, now visibly a multiple
    if WORDS:
        wk = k0 // 8 + tl.arange(0, COLS // 8)
        mask = rmask[:, None] if EVEN_K else rmask[:, None] & (wk[None, :] < row_bytes // 4)
        offs = tile_offsets(rows, wk, row_bytes // 4, TILED, _TILE_BYTES // 4)
        return tl.load(ptr.to(tl.pointer_type(tl.int32)) + offs, mask=mask, other=0)
    else:
        hk = k0 // 2 + tl.arange(0, COLS // 2)
        mask = rmask[:, None] if EVEN_K else rmask[:, None] & (hk[None, :] < row_bytes)
        return tl.load(ptr + tile_offsets(rows, hk, row_bytes, TILED, _TILE_BYTES), mask=mask, other=0)


@triton.jit
def _rotl(x, n: tl.constexpr):
    return (x << n) | (x >> (32 - n))


@triton.jit
def _byte_pair_bits(b):
    """The bf16x2 bits of one stored byte's two codes, code * 2^-126 each (magnitudes at 6-8 / 22-24, signs at
    15 / 31): what the word decoder's pair i must give for byte i."""
    return ((b & 7) << 6) | ((b & 8) << 12) | ((b & 0x70) << 18) | ((b & 0x80) << 24)


@triton.jit
def to_word_layout(packed, ROWS: tl.constexpr, COLS: tl.constexpr):
    """uint8 [ROWS, COLS // 2] stored bytes -> uint32 words [ROWS, COLS // 8] in the kernels' word layout: each
    byte's bf16x2 bits rotated to where `_word_codes_times_scale` takes them from (its inverse, so the KV
    append writes what the attention decodes; trace_lightning/quant/words.py is the table form)."""
    b = tl.reshape(packed.to(tl.uint32), (ROWS, COLS // 8, 2, 2))  # [.., a, c] = byte 2a + c of each word
    even, odd = tl.split(b)
    b0, b2 = tl.split(even)
    b1, b3 = tl.split(odd)
    return _word_from_bytes(b0, b1, b2, b3)


@triton.jit
def stored_words_to_word_layout(words):
    """int32 words of 4 stored bytes (byte i at bits 8i, as the quantizers encode them) -> the same words in the
    kernels' word layout (to_word_layout of their bytes)."""
    u = words.to(tl.uint32, bitcast=True)
    return _word_from_bytes(u & 0xFF, (u >> 8) & 0xFF, (u >> 16) & 0xFF, u >> 24).to(tl.int32, bitcast=True)


@triton.jit
def _word_from_bytes(b0, b1, b2, b3):
    """The word-layout uint32 of a word whose stored bytes are b0..b3 (uint32, 0..255 each)."""
    r3 = _byte_pair_bits(b3)
    return (_byte_pair_bits(b0) | _rotl(_byte_pair_bits(b1), 4) | _rotl(_byte_pair_bits(b2), 10)
            | _rotl(r3 & 0x00400040, 30) | _rotl(r3 & 0x81808180, 22))


@triton.jit
def load_scales(ptr, rows, row_blocks, k0, rmask, COLS: tl.constexpr, EVEN_K: tl.constexpr,
                TILED: tl.constexpr = False):
    """Block-scale bytes uint8 [len(rows), COLS // 16] of the K tile at column k0 (zero past the row's end);
    TILED: the scales are in the kernels' tiles.

    EVEN_K (the K extent and k0 are multiples of COLS): no column mask, and offsets written so that Triton
    sees their alignment, so a row's COLS // 16 bytes are one vector load, which Triton pipelines through
    cp.async. Otherwise each byte is a synchronous load whose result the dequantization waits for a few
    instructions later: a memory latency per K tile (sm_90 SASS of the gate/up loop)."""
    if EVEN_K:
        row_blocks = row_blocks // (COLS // 16) * (COLS // 16)  # the same value, now visibly a multiple
        sk = k0 // COLS * (COLS // 16) + tl.arange(0, COLS // 16)
        mask = rmask[:, None]
    else:
        sk = k0 // 16 + tl.arange(0, COLS // 16)
        mask = rmask[:, None] & (sk[None, :] < row_blocks)
    return tl.load(ptr + tile_offsets(rows, sk, row_blocks, TILED, _TILE_BYTES // 8), mask=mask, other=0)
