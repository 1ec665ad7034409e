"""One launch per recorded site: the quantizer's outputs straight into their slot of the packed record.

The torch twin (trace_lightning.sim.record) takes a dozen small kernels a site (byte views, the parity bits, a
concatenation, an indexed write); in a decode step of a 48-layer model that is thousands of launches. Here one
program writes one token's slot: its row globals' bytes, its block scale bytes and its payload (codes copied, or
their mantissa bits packed 8 per byte from each 4 code bytes), at the token's row of the record.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from trace_lightning.kernels._common import grid_dependency
from trace_lightning.kernels._fp4 import await_previous_grid


@triton.jit
def _record_slot_kernel(data_ptr, tokens_ptr, packed_ptr, scales_ptr, global_ptr, width, offset, G, NS, NP,
                        HAS_GLOBAL: tl.constexpr, PARITY: tl.constexpr, BLOCK: tl.constexpr,
                        PDL: tl.constexpr = False):
    await_previous_grid(PDL)
    m = tl.program_id(0).to(tl.int64)
    dst = data_ptr + tl.load(tokens_ptr + m) * width + offset
    lane = tl.arange(0, BLOCK)
    if HAS_GLOBAL:  # float32 row globals as their 4 little-endian bytes
        for g0 in range(0, G, BLOCK):
            r = g0 + lane
            bits = tl.load(global_ptr + m * G + r, mask=r < G, other=0.0).to(tl.int32, bitcast=True)
            for b in tl.static_range(4):
                tl.store(dst + 4 * r + b, ((bits >> (8 * b)) & 0xFF).to(tl.uint8), mask=r < G)
        dst += 4 * G
    for s0 in range(0, NS, BLOCK):
        i = s0 + lane
        tl.store(dst + i, tl.load(scales_ptr + m * NS + i, mask=i < NS), mask=i < NS)
    dst += NS
    if PARITY:  # element 2j (low nibble) and 2j + 1 (high) of code byte j of 4 -> bits 2j, 2j + 1 of one byte
        n_out = NP // 4
        for p0 in range(0, n_out, BLOCK):
            j = p0 + lane
            out = tl.zeros((BLOCK,), tl.int32)
            for b in tl.static_range(4):
                byte = tl.load(packed_ptr + m * NP + 4 * j + b, mask=j < n_out, other=0).to(tl.int32)
                out |= ((byte & 1) << (2 * b)) | (((byte >> 4) & 1) << (2 * b + 1))
            tl.store(dst + j, out.to(tl.uint8), mask=j < n_out)
    else:
        for p0 in range(0, NP, BLOCK):
            i = p0 + lane
            tl.store(dst + i, tl.load(packed_ptr + m * NP + i, mask=i < NP), mask=i < NP)


def write_record_slot(data: Tensor, tokens: Tensor, packed: Tensor, scale_bytes: Tensor, global_scale: Tensor | None,
                      offset: int, parity: bool) -> None:
    """Same contract as trace_lightning.sim.write_record_slot (Triton): M tokens' slots into data [..., width]."""
    if data.dtype != torch.uint8 or not data.is_contiguous():
        raise ValueError(f"the record must be a contiguous uint8 tensor, got {data.dtype} (contiguous: "
                         f"{data.is_contiguous()})")
    M = tokens.numel()
    packed, scale_bytes = packed.reshape(M, -1).contiguous(), scale_bytes.reshape(M, -1).contiguous()
    if parity and packed.shape[1] % 4:
        raise ValueError(f"parity bits need whole groups of 8 elements, got {packed.shape[1]} code bytes a token")
    g = None if global_scale is None else global_scale.float().reshape(M, -1).contiguous()
    G = 0 if g is None else g.shape[1]
    size = 4 * G + scale_bytes.shape[1] + (packed.shape[1] // 4 if parity else packed.shape[1])
    if offset < 0 or offset + size > data.shape[-1]:
        raise ValueError(f"a slot of {size} bytes at offset {offset} does not fit a {data.shape[-1]}-byte row")
    if M == 0:
        return
    _record_slot_kernel[(M,)](data, tokens.reshape(-1).contiguous(), packed, scale_bytes, scale_bytes if g is None
                              else g, data.shape[-1], offset, G, scale_bytes.shape[1], packed.shape[1],
                              g is not None, parity, 256, num_warps=2, **grid_dependency(data.device))
