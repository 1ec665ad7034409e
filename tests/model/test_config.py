"""Presets build with their published sizes; bad configs fail with clear messages."""

import pytest
import torch

from trace_lightning.model import MoEConfig, Transformer, name_to_config

# Published total parameter counts (billions), to 3 significant digits.
PUBLISHED = {"qwen3-30b-a3b": 30.5, "olmoe-1b-7b": 6.92, "mixtral-8x7b": 46.7, "qwen2-moe-a2.7b": 14.3}


def n_params(name: str) -> int:
    with torch.device("meta"):
        model = Transformer.from_name(name)
    return sum(p.numel() for p in model.parameters())


def test_debug_moe_is_about_one_million_parameters() -> None:
    c = MoEConfig.from_name("debug-moe")
    assert (c.dim, c.n_layers, c.n_heads, c.n_kv_heads, c.head_dim) == (128, 4, 4, 2, 32)
    assert (c.n_experts, c.top_k, c.moe_intermediate, c.vocab_size, c.qk_norm) == (8, 2, 64, 128, "head")
    assert c.norm_topk_prob
    assert 0.9e6 < n_params("debug-moe") < 1.1e6


def test_small_moe_fits_the_gpu_experiment_range() -> None:
    assert 100e6 < n_params("small-moe") < 300e6


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_real_presets_have_published_sizes(name: str) -> None:
    assert n_params(name) / 1e9 == pytest.approx(PUBLISHED[name], rel=5e-3)


@pytest.mark.parametrize("name", sorted(name_to_config))
def test_projection_inputs_tile_fp4_blocks(name: str) -> None:
    """Every quantized GEMM's input dim (D, Hq*Dh, I, I_shared) and Dh split into whole NVFP4 blocks
    (16); debug-moe also into MXFP4 blocks (32)."""
    c = MoEConfig.from_name(name)
    block = 32 if name == "debug-moe" else 16
    dims = [c.dim, c.q_dim, c.head_dim, c.moe_intermediate] + ([c.shared_intermediate] if c.n_shared_experts else [])
    assert all(d % block == 0 for d in dims), dims


def test_from_name_overrides_and_unknown_names() -> None:
    c = MoEConfig.from_name("debug-moe", n_layers=2, bf16_first_layers=1)
    assert c.n_layers == 2 and c.bf16_first_layers == 1 and c.name == "debug-moe"
    with pytest.raises(ValueError, match="known presets: .*debug-moe.*qwen3-30b-a3b"):
        MoEConfig.from_name("gpt-5")
    with pytest.raises(ValueError, match="unknown MoEConfig fields"):
        MoEConfig.from_name("debug-moe", n_layer=2)


@pytest.mark.parametrize(("overrides", "message"), [
    ({"n_kv_heads": 3}, "multiple of n_kv_heads"),
    ({"top_k": 9}, "top_k .* <= n_experts"),
    ({"head_dim": 31}, "even"),
    ({"dim": 0}, "dim must be positive"),
    ({"qk_norm": "layer"}, "qk_norm"),
    ({"router": "relu"}, "router"),
    ({"n_shared_experts": 1}, "shared_intermediate"),
    ({"shared_expert_gate": True}, "shared expert"),
    ({"bf16_first_layers": 3, "bf16_last_layers": 2}, "exceeds n_layers"),
])
def test_validation(overrides: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        MoEConfig.from_name("debug-moe", **overrides)


def test_boundary_layers() -> None:
    c = MoEConfig.from_name("debug-moe", bf16_first_layers=1, bf16_last_layers=1)
    assert [c.is_quantized_layer(i) for i in range(4)] == [False, True, True, False]
