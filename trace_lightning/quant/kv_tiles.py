"""The FP4 KV cache's value tiles: V codes and scales laid out for the decode attention's P V product.

Attention contracts P V over keys, and a 16-bit MMA operand holds two consecutive contraction elements in one
register: for V that is two keys at the same head dimension. A row-major cache gives the decoder two head dimensions
of one key per register instead, so the kernel had to transpose every dequantized V tile through shared memory
(16 KB a program and iteration at 64 keys: the largest shared-memory traffic of its loop). In value tiles each byte
holds the codes of two keys at one head dimension (an even key in the low nibble, the next key in the high one),
so the word decoder (trace_lightning/quant/words.py, applied to these bytes) yields the key pairs the MMA wants, and
the bytes are ordered so that a thread's 16 bytes per key pair are one load in the MMA's lane order.

Per (sequence, kv head), keys come in tiles of VALUE_TILE_KEYS = 16: key = 16 T + 8 q + 2 t + p (q < 2, t < 4,
p < 2), head dimension d = 16 g + 4 c + i (g < Dh / 16: the block, c < 4, i < 4). Tile T holds 32-bit words
[q][g][t][c], word (q, g, t, c) being the word layout of the 4 bytes i = 0..3 with byte i = code(key p = 0, d) |
code(key p = 1, d) << 4; and scale bytes [g][t][q][p] (so a thread's 4 scale bytes are one load too). Both keep
the stored shapes ([..., S, Dh / 2] bytes, [..., S, Dh / 16] scales, S a multiple of 16): a pure permutation of
bits within each tile, with an exact inverse. Per-row global scales are unchanged.
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor

from trace_lightning.quant.words import from_word_layout, to_word_layout

VALUE_TILE_KEYS = 16


def _check(packed: Tensor, scales: Tensor) -> tuple[int, int]:
    """(S, Dh) of a value cache [..., S, Dh / 2] codes and [..., S, Dh / 16] scale bytes that splits into tiles."""
    if packed.dtype != torch.uint8 or packed.dim() < 2 or scales.dim() != packed.dim():
        raise ValueError(f"value tiles need uint8 codes [..., S, Dh/2] and scales [..., S, Dh/16], got "
                         f"{packed.dtype} {tuple(packed.shape)} and {tuple(scales.shape)}")
    S, dh = packed.shape[-2], 2 * packed.shape[-1]
    if S % VALUE_TILE_KEYS or dh % 16 or tuple(scales.shape) != (*packed.shape[:-1], dh // 16):
        raise ValueError(f"value tiles need S % {VALUE_TILE_KEYS} == 0, Dh % 16 == 0 and scales [..., S, Dh/16]; got "
                         f"codes {tuple(packed.shape)}, scales {tuple(scales.shape)}")
    return S, dh


def to_value_tiles(packed: Tensor, scales: Tensor) -> tuple[Tensor, Tensor]:
    """Stored NVFP4 value rows (codes uint8 [..., S, Dh/2], scales [..., S, Dh/16]) -> value tiles (same shapes)."""
    S, dh = _check(packed, scales)
    lead, nb = packed.shape[:-2], dh // 16
    codes = torch.stack((packed & 15, packed >> 4), dim=-1).reshape(*lead, S // 16, 2, 4, 2, nb, 4, 4)
    # [.., T, q, t, p, g, c, i] -> bytes [.., T, q, g, t, c, i] of (p = 0) | (p = 1) << 4
    pairs = codes[..., 0, :, :, :] | (codes[..., 1, :, :, :] << 4)  # [.., T, q, t, g, c, i]
    tiled = to_word_layout(pairs.transpose(-4, -3).contiguous().view(*lead, S, dh // 2))
    s = scales.view(torch.uint8).reshape(*lead, S // 16, 2, 4, 2, nb)  # [.., T, q, t, p, g]
    s = s.permute(*range(len(lead)), -5, -1, -3, -4, -2).contiguous().view(scales.shape)  # [.., T, g, t, q, p]
    return tiled, s.view(scales.dtype)


def from_value_tiles(packed: Tensor, scales: Tensor) -> tuple[Tensor, Tensor]:
    """The inverse of to_value_tiles."""
    S, dh = _check(packed, scales)
    lead, nb = packed.shape[:-2], dh // 16
    pairs = from_word_layout(packed).reshape(*lead, S // 16, 2, nb, 4, 4, 4).transpose(-4, -3)  # [.., T, q, t, g, c, i]
    codes = torch.stack((pairs & 15, pairs >> 4), dim=-4)  # [.., T, q, t, p, g, c, i]
    rows = codes.reshape(*lead, S, dh // 2, 2)
    stored = rows[..., 0] | (rows[..., 1] << 4)
    s = scales.view(torch.uint8).reshape(*lead, S // 16, nb, 4, 2, 2)  # [.., T, g, t, q, p]
    s = s.permute(*range(len(lead)), -5, -2, -3, -1, -4).contiguous().view(scales.shape)  # [.., T, q, t, p, g]
    return stored, s.view(scales.dtype)


@functools.cache
def half_word_masks() -> tuple[int, int]:
    """(bits of the low-nibble key, bits of the high-nibble key) of a value-tile word, as int32: what one key's
    write clears and sets (the other key of its pair may be written by another program at the same time)."""
    lo = to_word_layout(torch.tensor([0x0F] * 4, dtype=torch.uint8)).view(torch.int32).item()
    hi = to_word_layout(torch.tensor([0xF0] * 4, dtype=torch.uint8)).view(torch.int32).item()
    return int(lo), int(hi)
