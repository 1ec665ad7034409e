"""The Triton kernels' word layout of NVFP4 codes: each 4 packed bytes (8 codes) with bits placed for the decoder.

In the stored NVFP4 order a code's sign sits 3 bits above its magnitude, where a bf16 wants it 9 bits above
(magnitude at bf16 bits 6-8, sign at 15, E2M1 code * 2^-126 exactly), so the decoder must place every code
on its own (`kernels/_fp4._codes_times_scale`: ~6 instructions per byte). GEMM weights (static between
syncs) and the FP4 KV cache (written once per token) are therefore held with their bits permuted
once per 32-bit word, such that three of the word's four bf16 pairs come out of one rotate and one mask and the
fourth out of two of each (13 instructions per 4 bytes with the scale multiplies). It is a pure bit
permutation: same bytes, same size, exact inverse.

Word bit map: the word W of 4 stored bytes (byte i at bits 8i) holds codes c[2i] (low nibble of byte i)
and c[2i + 1]; the decoder's pair i is the bf16x2 (c[2i], c[2i + 1]). `_WORD_BITS[i][h][b]` is the kernel
word's bit that holds bit b of code c[2i + h] (b = 3: the sign). Pair 0 is ``K & M``, pair 1
``rotr(K, 4) & M``, pair 2 ``rotr(K, 10) & M`` (M = 0x81C081C0: bf16 bits 6-8 and 15 of both halves),
pair 3 ``(rotl(K, 2) & 0x00400040) | (rotl(K, 10) & 0x81808180)``.

Tiles: a GEMM program reads, per K step, BLOCK_N rows of 64 packed bytes, which row-major storage scatters at
one-row strides (K / 2 bytes apart), and 8 scale bytes per row at K / 16 strides. On the H200 the same loop over
the same bytes ran at 45% of the copy ceiling row-major and 69% with each program's tile one contiguous run
(tools/probe_layout.py, H200 2026-12-03). So GEMM weights are also held in tiles of TILE_ROWS rows x
TILE_BYTES packed bytes (128 codes), each tile contiguous and row-major inside, and their scales in tiles of
TILE_ROWS x TILE_BYTES / 8 bytes: a pure permutation of whole 4-byte words (it commutes with the word bits).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from trace_lightning.quant.nvfp4 import NVFP4

TILE_ROWS = 32  # rows per tile: divides every BLOCK_N the GEMMs use (32, 64, 128)
TILE_BYTES = 64  # packed bytes per tile row (128 codes): the K step of the decode-sized GEMM tiles

_WORD_BITS = (
    ((6, 7, 8, 15), (22, 23, 24, 31)),
    ((10, 11, 12, 19), (26, 27, 28, 3)),
    ((16, 17, 18, 25), (0, 1, 2, 9)),
    ((4, 29, 30, 5), (20, 13, 14, 21)),
)


@functools.cache
def word_bit_map() -> tuple[tuple[int, int], ...]:
    """(stored bit, kernel bit) for all 32 bits of a word; a permutation (checked once)."""
    pairs = tuple((8 * i + 4 * h + b, _WORD_BITS[i][h][b]) for i in range(4) for h in range(2) for b in range(4))
    if sorted(k for _, k in pairs) != list(range(32)):
        raise AssertionError("the kernel word layout is not a bit permutation")
    return pairs


@functools.cache
def _byte_tables(forward: bool, device: torch.device) -> Tensor:
    """int32 [4, 256]: entry [j, v] is the permuted word of a word whose only nonzero byte is byte j = v. A bit
    permutation is linear over OR, so a word's image is the OR of its four bytes' entries."""
    ones = [(src, dst) if forward else (dst, src) for src, dst in word_bit_map()]
    values = torch.arange(256, dtype=torch.int64)
    table = torch.zeros(4, 256, dtype=torch.int64)
    for frm, to in ones:
        table[frm // 8] |= ((values >> (frm % 8)) & 1) << to
    return torch.where(table >= 2**31, table - 2**32, table).to(torch.int32).to(device)


def _permute_word_bits(packed: Tensor, forward: bool) -> Tensor:
    if packed.dtype != torch.uint8 or packed.shape[-1] % 4:
        raise ValueError(f"packed FP4 codes must be uint8 with a last dim divisible by 4 (4 bytes per word), "
                         f"got {packed.dtype} {tuple(packed.shape)}")
    table = _byte_tables(forward, packed.device)
    words = packed.contiguous().view(-1, 4)
    out = table[0][words[:, 0].long()]
    for j in range(1, 4):  # four table look-ups per word (a weight sync permutes every FP4 weight)
        out |= table[j][words[:, j].long()]
    return out.view(torch.uint8).view(packed.shape)


def to_word_layout(packed: Tensor) -> Tensor:
    """Stored NVFP4 bytes [..., K/2] -> the kernels' word layout (same shape and dtype)."""
    return _permute_word_bits(packed, True)


def from_word_layout(packed: Tensor) -> Tensor:
    """The inverse of to_word_layout."""
    return _permute_word_bits(packed, False)


def _fits_tiles(shape: Sequence[int], cols: int) -> bool:
    return len(shape) >= 2 and shape[-2] % TILE_ROWS == 0 and shape[-1] % cols == 0


def tileable(packed: Tensor | Sequence[int]) -> bool:
    """Whether packed codes [..., N, K/2] (or their shape) split into whole tiles (N % TILE_ROWS == 0, K/2 %
    TILE_BYTES == 0)."""
    return _fits_tiles(packed.shape if isinstance(packed, Tensor) else packed, TILE_BYTES)


def _check_tileable(t: Tensor, cols: int) -> None:
    if not _fits_tiles(t.shape, cols):
        raise ValueError(f"a tensor [..., N, C] splits into [{TILE_ROWS}, {cols}] tiles only if N % {TILE_ROWS} == 0 "
                         f"and C % {cols} == 0, got {tuple(t.shape)}")


def to_tiles(t: Tensor, cols: int) -> Tensor:
    """[..., N, C] -> the same shape with every [TILE_ROWS, cols] block contiguous (blocks in row-major order)."""
    _check_tileable(t, cols)
    *lead, n, c = t.shape
    return t.reshape(*lead, n // TILE_ROWS, TILE_ROWS, c // cols, cols).transpose(-3, -2).contiguous().view(t.shape)


def from_tiles(t: Tensor, cols: int) -> Tensor:
    """The inverse of to_tiles."""
    _check_tileable(t, cols)
    *lead, n, c = t.shape
    return t.reshape(*lead, n // TILE_ROWS, c // cols, TILE_ROWS, cols).transpose(-3, -2).contiguous().view(t.shape)


@dataclass
class WordNVFP4(NVFP4):
    """An NVFP4 weight whose `packed` bytes are in the GEMM kernels' word layout (see module docstring), and with
    `tiled` its packed bytes and scales also in the kernels' tiles (to_tiles).

    Only the Triton GEMMs read it; everything that inspects codes or scales (checksums, records, the sim) gets
    `canonical()`, which is exact."""

    tiled: bool = False

    @classmethod
    def from_stored(cls, q: NVFP4, tiled: bool = False) -> WordNVFP4:
        """q (stored order) in the word layout, and in tiles when `tiled`."""
        packed, scales = to_word_layout(q.packed), q.scales
        if tiled:
            packed = to_tiles(packed, TILE_BYTES)
            scales = to_tiles(scales.view(torch.uint8), TILE_BYTES // 8).view(q.scales.dtype)
        return cls(packed, scales, q.global_scale, tiled)

    def untiled(self) -> tuple[Tensor, Tensor]:
        """(packed bytes still in the word layout, scales), both in row-major order."""
        if not self.tiled:
            return self.packed, self.scales
        scales = from_tiles(self.scales.view(torch.uint8), TILE_BYTES // 8).view(self.scales.dtype)
        return from_tiles(self.packed, TILE_BYTES), scales

    def canonical(self) -> NVFP4:
        packed, scales = self.untiled()
        return NVFP4(from_word_layout(packed), scales, self.global_scale)

    def codes(self) -> Tensor:
        """Unpacked codes in stored order (so dequantize and with_codes see the real codes too)."""
        return self.canonical().codes()

    def scale_bytes(self) -> Tensor:
        return self.canonical().scale_bytes()

    def block_multiplier(self) -> Tensor:
        return self.canonical().block_multiplier()

    def scale_input(self, blocks: Tensor) -> Tensor:
        return self.canonical().scale_input(blocks)


def canonical(q: NVFP4) -> NVFP4:
    """The stored-order NVFP4 of q (q itself unless it is in the kernels' word layout)."""
    return q.canonical() if isinstance(q, WordNVFP4) else q
