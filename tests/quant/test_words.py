"""The word layout: an exact bit permutation whose PTX decoder (emulated here instruction by instruction)
gives every code as bf16 code * 2^-126, checked against ml_dtypes' float4_e2m1fn."""

import ml_dtypes
import numpy as np
import pytest
import torch

from trace_lightning.quant import NVFP4, unpack_fp4
from trace_lightning.quant.words import (
    TILE_ROWS,
    WordNVFP4,
    canonical,
    from_tiles,
    from_word_layout,
    tileable,
    to_tiles,
    to_word_layout,
    word_bit_map,
)


def _rotr(x: np.ndarray, n: int) -> np.ndarray:
    return ((x >> np.uint32(n)) | (x << np.uint32(32 - n))).astype(np.uint32)


def _rotl(x: np.ndarray, n: int) -> np.ndarray:
    return _rotr(x, 32 - n)


def emulate_word_decoder(words: np.ndarray) -> np.ndarray:
    """uint32 words -> their four bf16x2 pairs [..., 4] as _fp4._word_codes_times_scale computes them before the
    scale multiply (and.b32 / shf.r.wrap / shf.l.wrap / or.b32, same constants)."""
    m = np.uint32(0x81C081C0)
    pairs = [words & m, _rotr(words, 4) & m, _rotr(words, 10) & m,
             (_rotl(words, 2) & np.uint32(0x00400040)) | (_rotl(words, 10) & np.uint32(0x81808180))]
    return np.stack(pairs, axis=-1)


def test_word_layout_is_an_exact_bit_permutation() -> None:
    assert sorted(s for s, _ in word_bit_map()) == list(range(32))
    gen = torch.Generator().manual_seed(0)
    packed = torch.randint(0, 256, (3, 5, 64), generator=gen, dtype=torch.uint8)
    words = to_word_layout(packed)
    assert words.shape == packed.shape and words.dtype == torch.uint8
    assert not torch.equal(words, packed)
    assert torch.equal(from_word_layout(words), packed)
    one_bit = torch.zeros(32, 4, dtype=torch.uint8)  # each single set bit lands on its own word bit
    for bit in range(32):
        one_bit[bit, bit // 8] = 1 << (bit % 8)
    moved = to_word_layout(one_bit).view(torch.int32).flatten()
    assert sorted(int(v) & 0xFFFFFFFF for v in moved) == [1 << b for b in range(32)]


def test_word_decoder_gives_every_code_as_bf16() -> None:
    """Every code in every one of the 8 positions of a word (the other 7 random): the emulated decoder's bf16
    halves times 2^126 equal ml_dtypes' E2M1 values of the stored codes, rtol=0, atol=0."""
    rng = np.random.default_rng(1)
    stored = rng.integers(0, 256, size=(8 * 16 * 64, 4), dtype=np.uint8)
    for pos in range(8):  # force code `value` into position pos in block (pos, value)
        for value in range(16):
            rows = stored[(pos * 16 + value) * 64:(pos * 16 + value + 1) * 64]
            byte, shift = pos // 2, 4 * (pos % 2)
            rows[:, byte] = (rows[:, byte] & ~np.uint8(15 << shift)) | np.uint8(value << shift)
    words = to_word_layout(torch.from_numpy(stored)).numpy().view(np.uint32)[:, 0]
    pairs = emulate_word_decoder(words)  # [n, 4] uint32
    halves = np.stack([pairs & 0xFFFF, pairs >> 16], axis=-1).astype(np.uint16).reshape(-1, 8)
    got = halves.view(ml_dtypes.bfloat16).astype(np.float64) * 2.0**126
    codes = unpack_fp4(torch.from_numpy(stored)).numpy()  # [n, 8]: c[2i] low nibble of byte i
    want = codes.astype(np.uint8).view(ml_dtypes.float4_e2m1fn).astype(np.float64)
    np.testing.assert_array_equal(np.signbit(got), np.signbit(want))
    np.testing.assert_allclose(got, want, rtol=0, atol=0)


def test_word_layout_errors_and_canonical_view() -> None:
    with pytest.raises(ValueError, match="divisible by 4"):
        to_word_layout(torch.zeros(2, 6, dtype=torch.uint8))
    with pytest.raises(ValueError, match="uint8"):
        to_word_layout(torch.zeros(2, 8, dtype=torch.int32))
    gen = torch.Generator().manual_seed(2)
    q = NVFP4(torch.randint(0, 256, (4, 16), generator=gen, dtype=torch.uint8),
              torch.rand(4, 2, generator=gen).to(torch.float8_e4m3fn), torch.ones(4, 1))
    w = WordNVFP4(to_word_layout(q.packed), q.scales, q.global_scale)
    assert torch.equal(canonical(w).packed, q.packed) and canonical(q) is q
    assert torch.equal(w.codes(), q.codes()) and torch.equal(w.dequantize(), q.dequantize())


def test_sim_ops_read_word_layout_weights_in_stored_order() -> None:
    """A word-layout weight handed to the sim (e.g. by a caller mixing backends) gives the stored-order result."""
    from trace_lightning import sim
    from trace_lightning.sim.testing import quantize_weight

    gen = torch.Generator().manual_seed(4)
    q = quantize_weight(torch.randn(24, 64, generator=gen))
    w = WordNVFP4(to_word_layout(q.packed), q.scales, q.global_scale)
    x = torch.randn(5, 64, generator=gen)
    assert torch.equal(sim.fp4_linear(x, w), sim.fp4_linear(x, q))


def test_tiles_put_each_block_in_one_contiguous_run() -> None:
    t = torch.arange(2 * 64 * 128, dtype=torch.int32).reshape(2, 64, 128)
    tiles = to_tiles(t, 64)
    assert tiles.shape == t.shape and torch.equal(from_tiles(tiles, 64), t)
    flat = tiles.reshape(2, -1)
    block = TILE_ROWS * 64  # tile (expert e, row tile r, column tile c) is run (r * 2 + c) of expert e's matrix
    for e, r, c in ((0, 0, 0), (0, 0, 1), (1, 1, 0), (1, 1, 1)):
        run = flat[e, (r * 2 + c) * block:(r * 2 + c + 1) * block]
        assert torch.equal(run, t[e, r * TILE_ROWS:(r + 1) * TILE_ROWS, c * 64:(c + 1) * 64].reshape(-1))
    with pytest.raises(ValueError, match=r"\[32, 64\] tiles .* got \(2, 48, 128\)"):
        to_tiles(torch.zeros(2, 48, 128), 64)


def test_tiled_word_weight_reads_back_exactly() -> None:
    """Tiles (packed bytes and scales) and word bits undo exactly: codes, scale bytes, dequantized values, and the
    sim's GEMM on it are the stored order's; shapes that do not split into tiles are refused."""
    from trace_lightning import sim
    from trace_lightning.sim.testing import quantize_weight

    gen = torch.Generator().manual_seed(6)
    q = quantize_weight(torch.randn(96, 256, generator=gen))
    assert tileable(q.packed) and not tileable(q.packed[:, :32]) and not tileable(q.packed[:48])
    w = WordNVFP4.from_stored(q, tiled=True)
    assert w.tiled and w.shape == q.shape and not torch.equal(w.scale_bytes(), w.scales.view(torch.uint8))
    c = canonical(w)
    assert torch.equal(c.packed, q.packed) and torch.equal(c.scale_bytes(), q.scale_bytes())
    assert torch.equal(w.scale_bytes(), q.scale_bytes()) and torch.equal(w.dequantize(), q.dequantize())
    x = torch.randn(5, 256, generator=gen)
    assert torch.equal(sim.fp4_linear(x, w), sim.fp4_linear(x, q))
    with pytest.raises(ValueError, match="tiles"):
        WordNVFP4.from_stored(NVFP4(q.packed[:48], q.scales[:48], q.global_scale), tiled=True)
