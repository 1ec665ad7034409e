import torch
import torch.nn.functional as F

from trace_lightning.model import MoEConfig
from trace_lightning.ops import backend_for
from trace_lightning.quant import FP4Format, quantize_mxfp4, quantize_nvfp4, row_global_scale
from trace_lightning.rollout import FP4KVCache, KVCache

CFG = MoEConfig.from_name("debug-moe", n_layers=3, bf16_first_layers=1)
SIM = backend_for("cpu", "sim")


def kv(B: int, T: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    shape = (B, T, CFG.n_kv_heads, CFG.head_dim)
    return torch.randn(shape, generator=g), torch.randn(shape, generator=g) * 3


def test_dense_cache_writes_rows_at_their_positions() -> None:
    cache = KVCache(CFG, batch=2, max_len=8, dtype=torch.float32, device=torch.device("cpu"))
    k, v = kv(2, 3, 0)
    cache.visible = 3
    cache.update(0, k, v, torch.arange(3).expand(2, 3))
    k1, v1 = kv(2, 1, 1)
    cache.visible = 4
    positions = torch.tensor([[1], [3]])  # row 0 overwrites its padding at 1, row 1 appends at 3
    k_all, v_all, allowed = cache.update(0, k1, v1, positions)
    assert k_all.shape == (2, 4, CFG.n_kv_heads, CFG.head_dim)
    assert torch.equal(k_all[0, 1], k1[0, 0]) and torch.equal(k_all[0, 0], k[0, 0])
    assert torch.equal(k_all[1, 3], k1[1, 0]) and torch.equal(v_all[1, :3], v[1])
    assert allowed.tolist() == [[[True, True, False, False]], [[True, True, True, True]]]


def test_fp4_cache_holds_nvfp4_of_each_token_head() -> None:
    cache = FP4KVCache(CFG, 2, 8, torch.float32, torch.device("cpu"), SIM, FP4Format("nvfp4"))
    k, v = kv(2, 5, 2)
    positions = torch.tensor([[0, 1, 2, 3, 4], [2, 3, 4, 5, 6]])
    cache.visible = 7
    k_all, v_all, _ = cache.update(1, k, v, positions)
    store = cache.layers[1]
    for b in range(2):
        for t in range(5):
            p = int(positions[b, t])
            ref = quantize_nvfp4(k[b, t], row_global_scale(k[b, t]))  # one row per kv head
            assert torch.equal(store.k_packed[b, :, p], ref.packed)
            assert torch.equal(store.k_scales[b, :, p].view(torch.uint8), ref.scale_bytes())
            assert torch.equal(store.k_global[b, :, p], ref.global_scale)
            assert torch.equal(k_all[b, p], ref.dequantize())
            vref = quantize_nvfp4(v[b, t], row_global_scale(v[b, t]))
            assert torch.equal(v_all[b, p], vref.dequantize())
    assert 0 not in cache.layers and 0 in cache.k  # the bf16 boundary layer stays dense


def test_attention_on_fp4_cache_equals_attention_on_dequantized_kv() -> None:
    cache = FP4KVCache(CFG, 2, 16, torch.float32, torch.device("cpu"), SIM, FP4Format("nvfp4"))
    k, v = kv(2, 6, 3)
    cache.visible = 6
    cache.update(2, k, v, torch.arange(6).expand(2, 6))
    k1, v1 = kv(2, 1, 4)
    positions = torch.tensor([[6], [3]])  # ragged: row 1 is at position 3
    cache.visible = 7
    k_all, v_all, allowed = cache.update(2, k1, v1, positions)
    q = torch.randn(2, CFG.n_heads, 1, CFG.head_dim, generator=torch.Generator().manual_seed(5))
    scale = CFG.head_dim**-0.5
    ours = F.scaled_dot_product_attention(q, k_all.transpose(1, 2), v_all.transpose(1, 2), attn_mask=allowed[:, None],
                                          enable_gqa=True, scale=scale)
    fused = SIM.fp4_kv_attention(q, cache.layers[2], positions, scale)
    assert torch.allclose(ours, fused, atol=1e-5, rtol=1e-5)


def test_mxfp4_cache() -> None:
    cache = FP4KVCache(CFG, 1, 4, torch.bfloat16, torch.device("cpu"), SIM, FP4Format("mxfp4", mx_mode="rceil"))
    k, v = kv(1, 4, 6)
    cache.visible = 4
    k_all, v_all, _ = cache.update(1, k.bfloat16(), v.bfloat16(), torch.arange(4)[None])
    assert k_all.dtype == torch.bfloat16
    assert torch.equal(k_all, quantize_mxfp4(k.bfloat16(), "rceil").dequantize(torch.bfloat16))
    assert cache.nbytes() < KVCache(CFG, 1, 4, torch.bfloat16, torch.device("cpu")).nbytes()
