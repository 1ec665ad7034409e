"""Triton KV append (identical bytes in the record and the cache) and split-KV attention vs the sim."""

import math

import pytest
import torch

from trace_lightning import kernels, sim
from trace_lightning.kernels.kv import kv_attention
from trace_lightning.ops import FP4KVLayer

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")  # numpy, under the interpreter


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit-identical float32 tensors, any NaN equal to any NaN."""
    a, b = a.cpu(), b.cpu()
    nan = a.isnan()
    return torch.equal(nan, b.isnan()) and torch.equal(a[~nan].view(torch.int32), b[~nan].view(torch.int32))


def cache_tensors(layer: FP4KVLayer) -> list[torch.Tensor]:
    return [t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t
            for t in (layer.k_packed, layer.k_scales, layer.k_global, layer.v_packed, layer.v_scales, layer.v_global)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kv_append_bytes_match_sim(device: str, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(0)
    B, T, Hkv, S, Dh = 2, 5, 3, 9, 64
    k, v = (torch.randn(2, B, T, Hkv, Dh, generator=gen) * 4).to(dtype).to(device)
    k[0, 1, 2, 7] = float("nan")  # a non-finite row must stay NaN, in both backends
    positions = torch.tensor([[0, 1, 2, 7, 8], [3, -1, 4, 5, 6]], device=device)
    ours, theirs = FP4KVLayer.allocate(B, Hkv, S, Dh, device), FP4KVLayer.allocate(B, Hkv, S, Dh, device)
    for a, b in zip(kernels.kv_append(ours, k, v, positions), sim.kv_append(theirs, k, v, positions), strict=True):
        assert torch.equal(a.packed, b.packed) and torch.equal(a.scale_bytes(), b.scale_bytes())
        assert same_bits(a.global_scale, b.global_scale)
    for a, b in zip(cache_tensors(ours), cache_tensors(theirs), strict=True):
        assert same_bits(a, b) if a.dtype == torch.float32 else torch.equal(a, b)


LONG_SHAPE_EVERYWHERE = kernels.KernelOptions(attention=kernels.AttentionLaunch(32, 1, 3), attention_long=None)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("splits", [None, 1, 3])
@pytest.mark.parametrize("shape", ["default", "long_everywhere"])
def test_attention_matches_sim(device: str, dtype: torch.dtype, splits: int | None, shape: str) -> None:
    """Against the sim with the default launch shapes and with the long-stream shape (one warp, 32 keys) at every
    length."""
    options = LONG_SHAPE_EVERYWHERE if shape == "long_everywhere" else kernels.KernelOptions()
    gen = torch.Generator().manual_seed(1)
    B, Hq, Hkv, S, Dh, T = 2, 8, 2, 150, 64, 2
    layer = FP4KVLayer.allocate(B, Hkv, S, Dh, device)
    k, v = torch.randn(2, B, S, Hkv, Dh, generator=gen).to(device)
    sim.kv_append(layer, k, v, torch.arange(S, device=device).expand(B, S))
    q = torch.randn(B, Hq, T, Dh, generator=gen).to(dtype).to(device)
    q_pos = torch.tensor([[60, 61], [-1, 149]], device=device)
    with kernels.kernel_options(options):
        out = kv_attention(q, layer, q_pos, Dh**-0.5, splits)
    ref = sim.fp4_kv_attention(q.float(), layer, q_pos, Dh**-0.5)
    assert out.dtype == dtype and out.shape == q.shape
    assert out[1, :, 0].eq(0).all()
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.float(), ref, rtol=tol, atol=tol)


@pytest.mark.parametrize(("batch", "splits"), [(1, 33), (16, 7), (64, 2), (256, 1)])
def test_attention_splits_fill_whole_waves(monkeypatch: pytest.MonkeyPatch, batch: int, splits: int) -> None:
    """On an H200 (132 SMs, 4 attention programs each, the default) at 2K context, 64-key blocks, 4 kv heads: the
    split count minimises rounds x (blocks per program + 1). At batch 64 that is 2 splits (512 programs, one wave of
    17 blocks each), not the 3 a fill-the-chip rule picks (768 programs = 1.45 waves: two rounds of 11)."""
    from trace_lightning.kernels import kv as kv_kernels

    monkeypatch.setattr(kv_kernels, "sm_count", lambda device: 132)
    work, blocks = batch * 4, 33  # 2049 keys in 64-key blocks
    assert kernels.KernelOptions().attention_programs_per_sm == 4
    assert kv_kernels.attention_splits(work, 2049, 64, torch.device("cuda")) == splits
    with kernels.kernel_options(kernels.KernelOptions(attention_programs_per_sm=8)):  # twice the wave: fewer rounds
        assert kv_kernels.attention_splits(work, 2049, 64, torch.device("cuda")) == _best(work, blocks, 1056)

    assert splits == _best(work, blocks, 528)


def _best(work: int, blocks: int, wave: int) -> int:
    """The fewest splits of the least rounds x (blocks per program + 1), independent of the function under test."""

    def cost(s: int) -> int:
        per = -(-blocks // s)
        return -(-(work * -(-blocks // per)) // wave) * (per + 1)

    return min(range(1, blocks + 1), key=lambda s: (cost(s), -(-blocks // -(-blocks // s))))


def test_word_layout_cache_append_and_attention(device: str) -> None:
    """A cache in the kernels' word layout: the Triton append (its in-kernel encoder) writes exactly the table
    form's words of what a stored-order append writes, the sim's append writes the same, the record stays in
    stored order, and attention over it equals attention over the stored-order cache bit for bit (on CUDA
    through the word decoder, under the interpreter through an exact stored-order copy)."""
    from trace_lightning.quant.words import to_word_layout

    gen = torch.Generator().manual_seed(3)
    B, T, Hkv, G, S, Dh = 2, 6, 2, 4, 70, 128
    positions = torch.arange(T).expand(B, T).contiguous().to(device)
    k, v = (torch.randn(2, B, T, Hkv, Dh, generator=gen) * 3).to(torch.bfloat16).to(device)
    plain, words = FP4KVLayer.allocate(B, Hkv, S, Dh, device), FP4KVLayer.allocate(B, Hkv, S, Dh, device, words=True)
    twin = FP4KVLayer.allocate(B, Hkv, S, Dh, device, words=True)
    rec_plain = kernels.kv_append(plain, k, v, positions)
    rec_words = kernels.kv_append(words, k, v, positions)
    sim.kv_append(twin, k, v, positions)
    for a, b in zip(rec_plain, rec_words, strict=True):
        assert torch.equal(a.packed, b.packed)
    assert torch.equal(words.k_packed, to_word_layout(plain.k_packed))
    assert torch.equal(words.v_packed, to_word_layout(plain.v_packed))
    assert torch.equal(twin.k_packed, words.k_packed) and torch.equal(twin.v_packed, words.v_packed)
    assert torch.equal(words.dequantize_k(), plain.dequantize_k())
    q = torch.randn(B, Hkv * G, 1, Dh, generator=gen).to(torch.bfloat16).to(device)
    q_pos = torch.full((B, 1), T - 1, device=device)
    out_words = kernels.fp4_kv_attention(q, words, q_pos, Dh**-0.5)
    assert torch.equal(out_words, kernels.fp4_kv_attention(q, plain, q_pos, Dh**-0.5))
    assert torch.equal(sim.fp4_kv_attention(q, words, q_pos, Dh**-0.5), sim.fp4_kv_attention(q, plain, q_pos, Dh**-0.5))


def test_value_tile_cache_append_and_attention(device: str) -> None:
    """A cache whose values are in value tiles (quant/kv_tiles.py): the Triton append writes exactly to_value_tiles
    of what a stored-order append writes, also when the two keys of a pair arrive in different launches or a position
    is skipped; the sim's append writes the same; and attention over it equals attention over the stored-order cache
    bit for bit (on CUDA through the word decoder, under the interpreter through the portable decoder on the same
    tiles), at several splits and with the last tile partly past each query's length."""
    from trace_lightning.quant.kv_tiles import to_value_tiles

    gen = torch.Generator().manual_seed(4)
    B, T, Hkv, G, S, Dh = 2, 37, 2, 4, 40, 128
    positions = torch.arange(T).expand(B, T).clone()
    positions[1, 5] = -1
    positions = positions.to(device)
    k, v = (torch.randn(2, B, T, Hkv, Dh, generator=gen) * 3).to(torch.bfloat16).to(device)
    tiles = FP4KVLayer.allocate(B, Hkv, S, Dh, device, words=True, value_tiles=True)
    assert tiles.shape[2] == 48  # a whole number of 16-key tiles
    plain, twin = FP4KVLayer.allocate(B, Hkv, 48, Dh, device), FP4KVLayer.allocate(B, Hkv, 48, Dh, device,
                                                                                   value_tiles=True)
    kernels.kv_append(plain, k, v, positions)
    for t0, t1 in ((0, 11), (11, 12), (12, T)):  # key pairs 10/11 split across launches
        kernels.kv_append(tiles, k[:, t0:t1], v[:, t0:t1], positions[:, t0:t1])
    sim.kv_append(twin, k, v, positions)
    ref_packed, ref_scales = to_value_tiles(plain.v_packed, plain.v_scales)
    assert torch.equal(tiles.v_packed, ref_packed) and torch.equal(tiles.v_scales.view(torch.uint8),
                                                                    ref_scales.view(torch.uint8))
    assert torch.equal(twin.v_packed, tiles.v_packed) and torch.equal(tiles.v_global, plain.v_global)
    assert torch.equal(tiles.dequantize_v(), plain.dequantize_v())
    q = torch.randn(B, Hkv * G, 1, Dh, generator=gen).to(torch.bfloat16).to(device)
    q_pos = torch.tensor([[T - 1], [20]], device=device)
    for splits in (None, 2):
        out = kv_attention(q, tiles, q_pos, Dh**-0.5, splits)
        assert torch.equal(out, kv_attention(q, plain, q_pos, Dh**-0.5, splits))


def test_value_tile_cache_rejects_a_partial_tile() -> None:
    layer = FP4KVLayer.allocate(1, 1, 16, 64)
    with pytest.raises(ValueError, match="multiple of 16"):
        FP4KVLayer(*(t[:, :, :10] for t in layer.tensors()), value_tiles=True)


def test_value_tiles_where_the_fast_decoder_runs() -> None:
    assert kernels.prefers_value_tiles(torch.bfloat16, "cuda")
    assert not kernels.prefers_value_tiles(torch.float32, "cuda")
    assert not kernels.prefers_value_tiles(torch.float16, "cuda")
    assert not kernels.prefers_value_tiles(torch.bfloat16, "cpu")
    assert not sim.prefers_value_tiles(torch.bfloat16, "cuda")


def test_word_layout_where_the_fast_decoder_runs() -> None:
    """Weights and the KV cache alike take the word layout wherever the fast decoder runs (CUDA, bf16)."""
    for cache in (False, True):
        assert kernels.prefers_word_layout(torch.bfloat16, "cuda", cache=cache)
        assert not kernels.prefers_word_layout(torch.float32, "cuda", cache=cache)
        assert not kernels.prefers_word_layout(torch.bfloat16, "cpu", cache=cache)
        assert not sim.prefers_word_layout(torch.bfloat16, "cuda", cache=cache)


@pytest.mark.parametrize(("batch", "ctx", "keys"), [(64, 2048, 64), (256, 2048, 32), (250, 16896, 32), (1, 2048, 64)])
def test_attention_shape_by_keys_per_program(monkeypatch: pytest.MonkeyPatch, batch: int, ctx: int, keys: int) -> None:
    """Programs that stream 2K keys or more take the long shape (one warp, 32 keys), the rest 64 keys / 2 warps (the
    default KernelOptions): on an H200 at B=64 / 2K (2 splits of ~1K keys) the short one, at B=256 / 2K (one split)
    and B=250 / 16K the long; with no long shape, the one shape everywhere."""
    from trace_lightning.kernels import kv as kv_kernels

    monkeypatch.setattr(kv_kernels, "sm_count", lambda device: 132)
    S = ctx + 1
    splits = kv_kernels.attention_splits(batch * 4, S, 64, torch.device("cuda"))
    split_len = math.ceil(math.ceil(S / splits) / 64) * 64
    shape = kv_kernels.attention_shape(split_len)
    assert (shape.keys, shape.warps, shape.stages) == ((64, 2, 3) if keys == 64 else (32, 1, 3))
    one_shape = kernels.AttentionLaunch(128, 4, 2)
    with kernels.kernel_options(kernels.KernelOptions(attention=one_shape, attention_long=None)):
        assert kv_kernels.attention_shape(split_len) == one_shape
