"""Training-side NVFP4 fake quantization in one pass (Triton), bit for bit quant.fake.reference_fake_quantized.

The reference builds a site's straight-through value from some thirty elementwise torch ops (scales, codes, packing,
unpacking, a table lookup, the dequantize, then the scaled input again for the clamp mask), each a pass over the
activation; a training forward runs it at every FP4 site of every layer. Here one kernel reads x (and the record's
codes and scales) once and writes the two tensors the straight-through estimate needs: the dequantized value, in
x's dtype, and whether the scaled x lay inside E2M1's range.

- plain (fp4_qat, sites without a record): x's own row-global scales and RNE codes, computed and used in the same
  pass (the in-place record kernel with every row its own);
- guided by a site of a packed batch record (trace, trace_compact): read where it lies in the record's bytes, plain
  rounding at tokens without a record;
- guided by an NVFP4 tensor (the weights' own codes, a record's ref): the record's scales and row globals map x into
  E2M1 units in the quantizer's order (x * ((1 / global) / scale)); `full` takes the record's codes, `parity` the
  nearest magnitude of the recorded mantissa bit (ties to the smaller); a block whose x holds NaN or inf
  dequantizes to NaN with a mask of False (guided.mark_nonfinite_blocks).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from torch import Tensor

from trace_lightning.kernels._common import sm_count
from trace_lightning.kernels._fp4 import E2M1_CODE_BIAS, e2m1_magnitude, e2m1_to_f16_scaled, e4m3_to_f32, sign_eight
from trace_lightning.kernels.quantize import (
    _load_blocks,
    block_amax_bits,
    block_offsets,
    nvfp4_block_scales,
    row_global,
)
from trace_lightning.quant import NVFP4, BlockFP4, FP4Format
from trace_lightning.quant.guided import check_guidance_mode


@triton.jit
def _parity_index(mag, parity):
    """E2M1 magnitude index of the given parity nearest to mag (ties to the smaller; NaN: 0 or 1): quant.guided."""
    even = ((mag > 0.5).to(tl.int32) + (mag > 1.5).to(tl.int32) + (mag > 3.0).to(tl.int32)) * 2
    odd = ((mag > 1.0).to(tl.int32) + (mag > 2.25).to(tl.int32) + (mag > 4.5).to(tl.int32)) * 2 + 1
    return tl.where(parity != 0, odd, even)


@triton.jit
def _store_guided(x, code, s, g, inv_g, dq_ptr, inside_ptr, rows, k0, R, K, HAS_GLOBAL: tl.constexpr,
                  PARITY: tl.constexpr, NB: tl.constexpr):
    """Round a block_offsets tile x with block scales s [NB, BLOCK_R] (NaN where x's block holds NaN / inf) and row
    globals g (1 / g given) to `code` (full: the codes; parity: their bit 0 is the parity) and store the dequantized
    value and the inside mask."""
    if HAS_GLOBAL:
        r = tl.math.div_rn(tl.broadcast_to(inv_g[None, :], s.shape), s)
        mult = s * g[None, :]
    else:
        r = tl.math.div_rn(tl.full(s.shape, 1.0, tl.float32), s)
        mult = s
    y = x * r[:, :, None, None]
    if PARITY:
        negative = (y.to(tl.int32, bitcast=True) < 0).to(tl.int32)
        code = _parity_index(tl.abs(y), code & 1) | (negative << 3)
    value = e2m1_to_f16_scaled(code).to(tl.float32) * 16384.0
    offs, cols = block_offsets(rows, k0, K, 2, NB)
    mask = (rows[None, :, None, None] < R) & (cols < K)
    tl.store(dq_ptr + offs, (value * mult[:, :, None, None]).to(dq_ptr.dtype.element_ty), mask=mask)
    tl.store(inside_ptr + offs, (tl.abs(y) <= 6.0).to(tl.int8), mask=mask)


@triton.jit
def _guided_kernel(x_ptr, words_ptr, scales_ptr, g_ptr, dq_ptr, inside_ptr, R, K, HAS_GLOBAL: tl.constexpr,
                   PARITY: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr):
    NB: tl.constexpr = BLOCK_K // 16
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    g = None
    inv_g = None
    if HAS_GLOBAL:
        g = tl.load(g_ptr + rows, mask=rows < R, other=1.0)
        inv_g = tl.math.div_rn(tl.full((BLOCK_R,), 1.0, tl.float32), g)
    for k0 in range(0, K, BLOCK_K):
        x = _load_blocks(x_ptr, rows, k0, R, K, 2, NB)  # [NB, BLOCK_R, 2, 8]
        nb = k0 // 16 + tl.arange(0, NB)
        block_mask = (rows[None, :] < R) & (nb[:, None] < K // 16)
        byte = tl.load(scales_ptr + rows[None, :].to(tl.int64) * (K // 16) + nb[:, None], mask=block_mask, other=0)
        s = e4m3_to_f32(byte.to(tl.int32))
        s = tl.where(block_amax_bits(x) >= 0x7F800000, float("nan"), s)  # x's NaN / inf: the NaN scale
        word = k0 // 8 + tl.arange(0, NB)[:, None, None] * 2 + tl.arange(0, 2)[None, None, :]
        words = tl.load(words_ptr + rows[None, :, None].to(tl.int64) * (K // 8) + word,
                        mask=(rows[None, :, None] < R) & (word < K // 8), other=0)
        code = (words[:, :, :, None] >> (4 * tl.arange(0, 8)[None, None, None, :])) & 15
        _store_guided(x, code, s, g, inv_g, dq_ptr, inside_ptr, rows, k0, R, K, HAS_GLOBAL, PARITY, NB)


# Where the in-place kernel's rows take x's own rounding (row-global NVFP4, plain RNE) instead of the record's
OWN_NONE = tl.constexpr(0)  # nowhere: every token has a record
OWN_UNRECORDED = tl.constexpr(1)  # at tokens whose ok byte is 0
OWN_ALL = tl.constexpr(2)  # everywhere, no record read: plain fake quant in one pass


@triton.jit
def _record_guided_kernel(x_ptr, data_ptr, ok_ptr, dq_ptr, inside_ptr, R, K, ROWS: tl.constexpr, T, stride_b,
                          stride_t, g_off, s_off, p_off, HAS_GLOBAL: tl.constexpr, PARITY: tl.constexpr,
                          PARITY_PAYLOAD: tl.constexpr, OWN: tl.constexpr, BLOCK_R: tl.constexpr,
                          BLOCK_K: tl.constexpr):
    """_guided_kernel reading one site of a packed batch record (guidance.layout) where it lies: row i of x is row
    i % ROWS of token i // ROWS, whose bytes start at data + b * stride_b + t * stride_t; PARITY_PAYLOAD: the payload
    holds parity bits, else codes (which PARITY may still round by their parity). Rows that OWN names take x's own
    rounding instead (quant.fake.with_own_rounding's codes, scales and row global: plain RNE), the global from a
    first pass over their rows."""
    NB: tl.constexpr = BLOCK_K // 16
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    live = rows < R
    token = rows // ROWS
    row_in_token = rows % ROWS
    base = (token // T).to(tl.int64) * stride_b + (token % T).to(tl.int64) * stride_t
    if OWN == OWN_UNRECORDED:
        ok = tl.load(ok_ptr + token, mask=live, other=1) != 0
    g = None
    inv_g = None
    if HAS_GLOBAL:
        if OWN == OWN_ALL:
            g = row_global(x_ptr, R, K, rows, BLOCK_R, BLOCK_K)
        else:  # the float32 row global's 4 little-endian bytes
            g_at = data_ptr + base + g_off + 4 * row_in_token
            g_bits = tl.zeros((BLOCK_R,), tl.int32)
            for i in tl.static_range(4):
                g_bits = g_bits | (tl.load(g_at + i, mask=live, other=0).to(tl.int32) << (8 * i))
            g = tl.where(live, g_bits.to(tl.float32, bitcast=True), 1.0)
            if OWN == OWN_UNRECORDED:
                g = tl.where(ok, g, row_global(x_ptr, R, K, rows, BLOCK_R, BLOCK_K))
        inv_g = tl.math.div_rn(tl.full((BLOCK_R,), 1.0, tl.float32), g)
    for k0 in range(0, K, BLOCK_K):
        x = _load_blocks(x_ptr, rows, k0, R, K, 2, NB)  # [NB, BLOCK_R, 2, 8]
        amax_bits = block_amax_bits(x)
        if OWN != OWN_NONE:  # x's own block scales and RNE codes (their parity, in parity mode)
            if HAS_GLOBAL:
                own_byte, own_r, _ = nvfp4_block_scales(amax_bits, g[None, :], inv_g[None, :], True)
            else:
                own_byte, own_r, _ = nvfp4_block_scales(amax_bits, None, None, False)
            own, _ = e2m1_magnitude(tl.abs(x * own_r[:, :, None, None]))
            own = own - E2M1_CODE_BIAS + sign_eight(x)
        if OWN == OWN_ALL:
            byte = own_byte
            code = own
        else:
            nb = k0 // 16 + tl.arange(0, NB)
            block_mask = live[None, :] & (nb[:, None] < K // 16)
            byte = tl.load(data_ptr + base[None, :] + s_off + row_in_token[None, :] * (K // 16) + nb[:, None],
                           mask=block_mask, other=0).to(tl.int32)
            _, cols = block_offsets(rows, k0, K, 2, NB)
            at = data_ptr + base[None, :, None, None] + p_off
            payload_mask = live[None, :, None, None] & (cols < K)
            if PARITY_PAYLOAD:  # 8 mantissa bits a byte, element i at bit i % 8
                bits = tl.load(at + row_in_token[None, :, None, None] * (K // 8) + cols // 8, mask=payload_mask,
                               other=0)
                code = (bits.to(tl.int32) >> (cols % 8)) & 1
            else:  # 2 codes a byte, the even element in the low nibble
                pair = tl.load(at + row_in_token[None, :, None, None] * (K // 2) + cols // 2, mask=payload_mask,
                               other=0)
                code = (pair.to(tl.int32) >> (4 * (cols % 2))) & 15
            if OWN == OWN_UNRECORDED:
                byte = tl.where(ok[None, :], byte, own_byte)
                code = tl.where(ok[None, :, None, None], code, own)
        s = tl.where(amax_bits >= 0x7F800000, float("nan"), e4m3_to_f32(byte))  # x's NaN / inf: the NaN scale
        _store_guided(x, code, s, g, inv_g, dq_ptr, inside_ptr, rows, k0, R, K, HAS_GLOBAL, PARITY, NB)


def _launch(R: int, K: int, device: torch.device) -> tuple[tuple[int], int, int, int]:
    """(grid, BLOCK_R, BLOCK_K, warps): about 4096 elements a program, enough programs to fill the chip."""
    return _launch_for(R, K, sm_count(device))


@functools.lru_cache(maxsize=1024)
def _launch_for(R: int, K: int, sms: int) -> tuple[tuple[int], int, int, int]:
    # Remembered per shape: a training forward launches some sixty of these kernels on the host's critical path, and
    # triton.cdiv and next_power_of_2 cost ~2 us a call.
    block_k = min(triton.next_power_of_2(K), 1024)
    block_r = max(1, min(4096 // block_k, triton.next_power_of_2(R)))
    while block_r > 1 and triton.cdiv(R, block_r) < 2 * sms:
        block_r //= 2
    return (triton.cdiv(R, block_r),), block_r, block_k, max(1, min(8, block_r * block_k // 512))


def _rows(t: Tensor, width: int) -> Tensor:
    return t.reshape(-1, width).contiguous()


def _rows_and_outputs(x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """x as contiguous rows [R, K], and the (value, inside) tensors of x's shape the kernels write."""
    return (_rows(x, x.shape[-1]), torch.empty(x.shape, dtype=x.dtype, device=x.device),
            torch.empty(x.shape, dtype=torch.bool, device=x.device))


def _words(packed: Tensor) -> Tensor:
    """Packed codes [R, K / 2] as int32 words (8 codes each), copied where the view would be misaligned."""
    if packed.data_ptr() % 4:
        packed = packed.clone()
    return packed.view(torch.int32)


def guided_fake_quantized(x: Tensor, ref: BlockFP4, mode: str) -> tuple[Tensor, Tensor]:
    """(value in x's dtype, inside mask) of x rounded with NVFP4 record `ref` in mode "full" or "parity" (Triton);
    equal to quant.fake.reference_fake_quantized(x, fmt, ref, mode) bit for bit."""
    check_guidance_mode(mode)
    if not isinstance(ref, NVFP4):
        raise ValueError(f"the fused guided quantizer takes an NVFP4 record, got {type(ref).__name__}")
    if tuple(x.shape) != tuple(ref.shape):
        raise ValueError(f"input shape {tuple(x.shape)} does not match the record's shape {tuple(ref.shape)}")
    K = x.shape[-1]
    x2, value, inside = _rows_and_outputs(x)
    R = x2.shape[0]
    g = ref.global_scale
    g_rows = None if g is None else torch.broadcast_to(g.float(), (*x.shape[:-1], 1)).reshape(R).contiguous()
    if R == 0:
        return value, inside
    grid, block_r, block_k, warps = _launch(R, K, x.device)
    _guided_kernel[grid](
        x2, _words(_rows(ref.packed, K // 2)), _rows(ref.scale_bytes(), K // 16),
        g_rows if g_rows is not None else x2, value, inside.view(torch.int8), R, K, g_rows is not None,
        mode == "parity", block_r, block_k, num_warps=warps)
    return value, inside


def record_guided_fake_quantized(x: Tensor, data: Tensor, offsets: tuple[int, int, int], has_global: bool,
                                 payload: str, mode: str, recorded: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """(value in x's dtype, inside mask) of x [B, T, *rows, K] rounded to one site of a packed NVFP4 batch record
    (Triton), read in place: data uint8 [B, T, width] (views welcome), offsets (globals, scale bytes, payload) of
    the site's slot in a token's row (guidance.layout.SiteSlot), payload the record's mode (its payload holds codes,
    "full", or parity bits, "parity"), mode the rounding's ("full" needs codes). recorded (B, T) bool, or None when
    every token has a record: tokens without one round plainly with x's own row-global scales. Equal, bit for bit, to
    guided_fake_quantized of the site's ref with quant.fake.with_own_rounding at the unrecorded tokens, without the
    ref's copies, the parity bits' unpacking, the own quantization's bytes or the selects."""
    check_guidance_mode(mode)
    if check_guidance_mode(payload) == "parity" and mode == "full":
        raise ValueError("guidance mode 'full' needs full records, this record holds parity bits only")
    if x.dim() < 3 or tuple(data.shape[:2]) != tuple(x.shape[:2]) or data.dtype != torch.uint8 or data.stride(-1) != 1:
        raise ValueError(f"activation of shape {tuple(x.shape)} does not match a uint8 record of rows "
                         f"(B, T) = {tuple(data.shape[:2])}")
    B, T, K = x.shape[0], x.shape[1], x.shape[-1]
    if K % 16:
        raise ValueError(f"NVFP4 rows must be a multiple of 16 elements, got {K}")
    if recorded is not None and tuple(recorded.shape) != (B, T):
        raise ValueError(f"recorded mask of shape {tuple(recorded.shape)} does not match (B, T) = {(B, T)}")
    x2, value, inside = _rows_and_outputs(x)
    R = x2.shape[0]
    if R == 0:
        return value, inside
    ok = x2 if recorded is None else recorded.reshape(B * T).view(torch.int8)  # a view: no launch
    grid, block_r, block_k, warps = _launch(R, K, x.device)
    _record_guided_kernel[grid](
        x2, data, ok, value, inside.view(torch.int8), R, K, R // (B * T), T, data.stride(0), data.stride(1),
        *offsets, has_global, mode == "parity", payload == "parity", OWN_NONE if recorded is None else OWN_UNRECORDED,
        block_r, block_k, num_warps=warps)
    return value, inside


def plain_fake_quantized(x: Tensor) -> tuple[Tensor, Tensor]:
    """(value in x's dtype, inside mask) of x's row-global NVFP4 (Triton), as reference_fake_quantized(x, "nvfp4")
    gives them: the in-place record kernel with every row its own, so one pass writes them (no codes or scales
    stored and read back)."""
    if x.dim() == 0 or x.shape[-1] % 16:
        raise ValueError(f"NVFP4 rows must be a multiple of 16 elements, got shape {tuple(x.shape)}")
    K = x.shape[-1]
    x2, value, inside = _rows_and_outputs(x)
    R = x2.shape[0]
    if R == 0:
        return value, inside
    grid, block_r, block_k, warps = _launch(R, K, x.device)
    _record_guided_kernel[grid](
        x2, x2, x2, value, inside.view(torch.int8), R, K, 1, 1, 0, 0, 0, 0, 0, True, False, False, OWN_ALL, block_r,
        block_k, num_warps=warps)
    return value, inside


def takes(x: Tensor, fmt: FP4Format) -> bool:
    """Whether the fused kernels compute x's fake quant in `fmt`: NVFP4, whole 16-element blocks, float32 or
    bfloat16 (the reference's torch ops take everything else)."""
    return fmt.kind == "nvfp4" and x.dim() > 0 and x.shape[-1] % 16 == 0 and x.dtype in (torch.float32, torch.bfloat16)


def fused_fake_quantized(x: Tensor, fmt: FP4Format, ref: BlockFP4 | None = None,
                         mode: str | None = None) -> tuple[Tensor, Tensor] | None:
    """The fused kernels' (value, inside) where they apply, else None (the caller then runs the reference): guided by
    an NVFP4 record (row, matrix or no global scale), or plain NVFP4 with row globals; float32 or bfloat16 x."""
    if not takes(x, fmt):
        return None
    if ref is not None:
        return guided_fake_quantized(x, ref, mode or "parity") if isinstance(ref, NVFP4) else None
    if fmt.global_scale != "row":
        return None
    return plain_fake_quantized(x)
