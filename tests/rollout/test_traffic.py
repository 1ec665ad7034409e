"""The bytes a decode step must move: what an engine benchmark's roofline fraction divides by."""

import math

import pytest
import torch

from trace_lightning.guidance.compaction import route_bytes_per_token
from trace_lightning.model import MoEConfig, Transformer
from trace_lightning.rollout import CaptureSpec, Engine, FP4Precision
from trace_lightning.rollout.traffic import decode_step_traffic, experts_touched


def test_experts_touched_is_the_uniform_routing_expectation() -> None:
    assert experts_touched(4, 2, 2) == pytest.approx(3.0)  # an expert is missed by both tokens with p = 1/4
    assert experts_touched(128, 8, 1) == pytest.approx(8.0)
    assert experts_touched(128, 8, 0) == 0.0
    assert experts_touched(128, 8, 64) == pytest.approx(128 * (1 - (120 / 128) ** 64))  # ~126.4 of 128
    g = torch.Generator().manual_seed(0)  # against sampling: 2000 batches of 16 tokens, top-8 of 64 uniformly
    counts = [len(set(torch.stack([torch.randperm(64, generator=g)[:8] for _ in range(16)]).flatten().tolist()))
              for _ in range(2000)]
    assert sum(counts) / len(counts) == pytest.approx(experts_touched(64, 8, 16), rel=0.01)
    with pytest.raises(ValueError, match="top_k"):
        experts_touched(8, 9, 1)


def test_engine_weight_bytes_are_its_fp4_codes_and_scales_and_sum_to_weight_bytes() -> None:
    torch.manual_seed(0)
    c = MoEConfig.from_name("debug-moe")
    for precision in ("bf16", FP4Precision(compute_dtype="bf16")):
        engine = Engine(Transformer(c), precision)
        held = engine.weight_bytes_by_name()
        assert sum(held.values()) == engine.weight_bytes()
        assert held["layers.1.attn.wo.weight"] == (c.dim * c.q_dim * 2 if precision == "bf16" else
                                                   c.dim * c.q_dim // 2 + c.dim * c.q_dim // 16 + 4)  # + global
    experts = c.n_experts * 2 * c.moe_intermediate * c.dim
    assert held["layers.0.moe.experts.w13"] == experts // 2 + experts // 16 + 4 * c.n_experts  # one global per expert


@pytest.mark.parametrize("batch", [1, 4, 64])
def test_decode_step_traffic_counts_touched_experts_embedding_rows_cache_and_records(batch: int) -> None:
    torch.manual_seed(0)
    c = MoEConfig.from_name("debug-moe")
    engine = Engine(Transformer(c), FP4Precision(compute_dtype="bf16"))
    held = engine.weight_bytes_by_name()
    capture = CaptureSpec(mode="parity")
    t = engine.decode_step_traffic(batch, context=100, capture=capture)
    experts = sum(v for k, v in held.items() if ".experts." in k)
    embedding = held["tok_embeddings.weight"]
    rest = sum(held.values()) - experts - embedding
    touched = 1 - (1 - c.top_k / c.n_experts) ** batch
    assert t.weights == pytest.approx(rest + experts * touched + embedding * batch / c.vocab_size)
    # FP4 K and V of every layer: head_dim/2 code bytes + head_dim/16 scales + a 4-byte global per head and position
    per_position = c.n_layers * 2 * c.n_kv_heads * (c.head_dim // 2 + c.head_dim // 16 + 4)
    assert t.kv == pytest.approx(batch * 101 * per_position)
    width = engine.record_layout(capture).width
    assert t.records == batch * (width + route_bytes_per_token(c)) and width > 0
    assert t.total == t.weights + t.kv + t.records
    dense = Engine(Transformer(c), "bf16").decode_step_traffic(batch, context=100)
    assert dense.kv == batch * 101 * c.n_layers * 2 * c.kv_dim * 2 and dense.weights > t.weights * 3
    assert math.isclose(decode_step_traffic(c, held, 0, 0, 0).weights, rest)  # no token: dense weights only
