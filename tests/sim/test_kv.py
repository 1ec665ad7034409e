"""sim FP4 KV cache: append bytes are the row quantizer's, attention is SDPA over the dequantized cache."""

import pytest
import torch
import torch.nn.functional as F

from trace_lightning import sim
from trace_lightning.ops import FP4KVLayer


def filled_cache(B: int, Hkv: int, S: int, Dh: int, length: int, gen: torch.Generator) -> FP4KVLayer:
    layer = FP4KVLayer.allocate(B, Hkv, S, Dh)
    k, v = torch.randn(2, B, length, Hkv, Dh, generator=gen)
    sim.kv_append(layer, k, v, torch.arange(length).expand(B, length))
    return layer


def test_kv_append_writes_torchaos_row_quantized_bytes(torchao_fp4) -> None:
    gen = torch.Generator().manual_seed(0)
    layer = FP4KVLayer.allocate(2, 3, 10, 32)
    k, v = torch.randn(2, 2, 4, 3, 32, generator=gen)
    positions = torch.tensor([[0, 5, 6, 9], [2, 3, -1, 4]])
    qk, qv = sim.kv_append(layer, k, v, positions)
    k_packed, k_scales, k_global = torchao_fp4.nvfp4_rows(k)
    v_packed, v_scales, v_global = torchao_fp4.nvfp4_rows(v)
    assert torch.equal(qk.packed, k_packed) and torch.equal(qv.scale_bytes(), v_scales)
    for b in range(2):
        for t in range(4):
            p = int(positions[b, t])
            if p < 0:
                continue
            assert torch.equal(layer.k_packed[b, :, p], k_packed[b, t])
            assert torch.equal(layer.k_scales[b, :, p].view(torch.uint8), k_scales[b, t])
            assert torch.equal(layer.v_scales[b, :, p].view(torch.uint8), v_scales[b, t])
            assert torch.equal(layer.v_packed[b, :, p], v_packed[b, t])
            assert torch.equal(layer.k_global[b, :, p], k_global[b, t])
            assert torch.equal(layer.v_global[b, :, p], v_global[b, t])
    assert layer.k_packed[1, :, 7].eq(0).all()  # the skipped (-1) token wrote nothing
    assert torch.equal(layer.dequantize_k()[0, :, 5], torchao_fp4.nvfp4_rows_dequantized(k, torch.float32)[0, 1])


@pytest.mark.parametrize("T", [1, 3])
def test_attention_matches_sdpa_on_dequantized_cache(T: int) -> None:
    gen = torch.Generator().manual_seed(1)
    B, Hq, Hkv, S, Dh = 2, 4, 2, 12, 32
    layer = filled_cache(B, Hkv, S, Dh, S, gen)
    q = torch.randn(B, Hq, T, Dh, generator=gen)
    q_pos = torch.tensor([[8 + t for t in range(T)], [3 + 2 * t for t in range(T)]])
    out = sim.fp4_kv_attention(q, layer, q_pos, sm_scale=Dh**-0.5)
    mask = torch.arange(S) <= q_pos[:, None, :, None]  # (B, 1, T, S)
    ref = F.scaled_dot_product_attention(q, layer.dequantize_k(), layer.dequantize_v(), attn_mask=mask, enable_gqa=True)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


def test_attention_negative_position_gives_zeros() -> None:
    gen = torch.Generator().manual_seed(2)
    layer = filled_cache(1, 1, 4, 16, 4, gen)
    out = sim.fp4_kv_attention(torch.randn(1, 2, 2, 16, generator=gen), layer, torch.tensor([[-1, 2]]), 0.25)
    assert out[:, :, 0].eq(0).all() and out[:, :, 1].abs().sum() > 0
