"""Triton device helpers shared by the FP4 kernels: bit-exact E2M1 / E4M3 / E8M0 arithmetic.

Everything that decides a byte is done with integer bit operations or IEEE-rounded float32 ops
(`div_rn`, plain multiplies), never with approximate hardware conversions, so the bytes equal the
torch reference on GPU and under TRITON_INTERPRET=1 alike, on Triton 3.6 and 3.9.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def nan_free_abs(x):
    """|x| with NaN replaced by 0 (so tl.max never sees NaN), plus a 0/1 NaN indicator."""
    is_nan = x != x
    return tl.where(is_nan, 0.0, tl.abs(x)), is_nan.to(tl.int32)


@triton.jit
def encode_e2m1(y):
    """E2M1 codes (int32 0..15) of float32 y: RNE, saturating, -0 keeps its sign, NaN -> 7 (the sim's rule)."""
    a = tl.abs(y)
    m = (a > 0.25).to(tl.int32) + (a >= 0.75).to(tl.int32) + (a > 1.25).to(tl.int32) + (a >= 1.75).to(tl.int32)
    m += (a > 2.5).to(tl.int32) + (a >= 3.5).to(tl.int32) + (a > 5.0).to(tl.int32)
    sign = (y.to(tl.int32, bitcast=True) >> 31) & 1
    return tl.where(y != y, 7, m | (sign << 3))


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
def dequant_pairs(packed, scale_bytes, DTYPE: tl.constexpr):
    """Bytes (two codes each) and the E4M3 scale byte of their block, same shape -> (even, odd) values
    code * scale in DTYPE (exact in bf16: <= 6 significant bits; global scale left out).

    Even and odd elements come back as separate tensors so GEMMs take two dots over K/2 (K order is free)
    instead of interleaving registers; the scale goes through the same fp16 bit trick (E4M3 * 2^-8).
    """
    p = packed.to(tl.int32)
    b = scale_bytes.to(tl.int32)
    s = ((b & 0x7F) << 7).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32) * 4194304.0  # * 2^(8 + 14)
    s = tl.where((b & 0x7F) == 0x7F, float("nan"), s)
    lo = e2m1_to_f16_scaled(p & 15).to(tl.float32) * s
    hi = e2m1_to_f16_scaled(p >> 4).to(tl.float32) * s
    return lo.to(DTYPE), hi.to(DTYPE)
