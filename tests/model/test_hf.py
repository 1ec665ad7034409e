"""Hugging Face conversion: logit and routing parity with transformers for every family, round trips,
both expert layouts, shards, and clear errors that leave the model untouched."""

import dataclasses
import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import Tensor
from transformers import AutoModelForCausalLM, MixtralConfig, OlmoeConfig, Qwen2MoeConfig, Qwen3MoeConfig

from trace_lightning.model import (
    CheckpointError,
    MoEConfig,
    Transformer,
    config_from_hf,
    config_to_hf,
    load_hf,
    load_hf_weights,
    name_to_config,
    save_hf,
)

V, B, T, K = 96, 2, 10, 2
COMMON = dict(vocab_size=V, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              max_position_embeddings=128, num_experts_per_tok=K)
FAMILIES = {
    "qwen3": lambda: Qwen3MoeConfig(**COMMON, head_dim=32, moe_intermediate_size=32, num_experts=6,
                                    norm_topk_prob=True),
    "qwen3-raw-topk-tied": lambda: Qwen3MoeConfig(**COMMON, head_dim=16, moe_intermediate_size=32, num_experts=6,
                                                  norm_topk_prob=False, tie_word_embeddings=True),
    "olmoe": lambda: OlmoeConfig(**COMMON, intermediate_size=32, num_experts=6, pad_token_id=0, eos_token_id=1),
    "mixtral": lambda: MixtralConfig(**COMMON, intermediate_size=32, num_local_experts=6),
    "qwen2-moe": lambda: Qwen2MoeConfig(**COMMON, moe_intermediate_size=32, shared_expert_intermediate_size=48,
                                        num_experts=6),
}


def hf_model(family: str, seed: int = 0) -> torch.nn.Module:
    """A tiny transformers model with every parameter randomised (norms and biases too, so a swapped
    tensor cannot hide behind an all-ones init)."""
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(FAMILIES[family](), attn_implementation="eager").eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.15) if p.dim() > 1 else p.uniform_(0.5, 1.5)
    return model


def ids(seed: int = 1) -> Tensor:
    return torch.randint(0, V, (B, T), generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, torch.nn.Module]]:
    out = {}
    for family in FAMILIES:
        model = hf_model(family)
        path = tmp_path_factory.mktemp(family)
        model.save_pretrained(path)
        out[family] = path, model
    return out


def hf_logits_and_routes(model: torch.nn.Module, x: Tensor) -> tuple[Tensor, list[Tensor]]:
    with torch.no_grad():
        out = model(x, output_router_logits=True)
    routes = [r.float().softmax(-1).topk(K, dim=-1).indices.view(B, T, K) for r in out.router_logits]
    return out.logits, routes


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_logits_and_routes_match_transformers(family: str, checkpoints: dict) -> None:
    path, hf = checkpoints[family]
    model = load_hf(path)
    assert model.config.hf_architecture == hf.config.architectures[0]
    ref_logits, ref_routes = hf_logits_and_routes(hf, ids())
    with torch.no_grad():
        out = model(ids(), return_routes=True)
    assert (out.logits - ref_logits).abs().max() <= 1e-4
    for ours, theirs in zip(out.routes, ref_routes, strict=True):
        assert torch.equal(ours, theirs)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_save_hf_writes_hub_layout_that_transformers_loads(family: str, checkpoints: dict, tmp_path: Path) -> None:
    path, hf = checkpoints[family]
    model = load_hf(path)
    save_hf(model, tmp_path)
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
    expert = "block_sparse_moe.experts.5.w2.weight" if family == "mixtral" else "mlp.experts.5.down_proj.weight"
    assert f"model.layers.1.{expert}" in keys
    assert not any("gate_up_proj" in k for k in keys)
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        assert keys == set(f.keys())  # exactly what transformers itself writes
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="eager").eval()
    with torch.no_grad():
        torch.testing.assert_close(reloaded(ids()).logits, model(ids()), rtol=0, atol=1e-4)


@pytest.mark.parametrize("family", ["qwen3", "mixtral", "qwen2-moe"])
def test_fused_expert_layout_loads(family: str, checkpoints: dict, tmp_path: Path) -> None:
    """transformers >= 5 keeps experts fused in memory (mlp.experts.gate_up_proj [E, 2I, D]); accept that file."""
    path, hf = checkpoints[family]
    state = {k: v.contiguous() for k, v in hf.state_dict().items()}
    assert "model.layers.0.mlp.experts.gate_up_proj" in state
    if hf.config.tie_word_embeddings:
        state.pop("lm_head.weight")
    save_file(state, str(tmp_path / "model.safetensors"))
    shutil.copy(path / "config.json", tmp_path / "config.json")
    fused, per_expert = load_hf(tmp_path), load_hf(path)
    for (k, a), b in zip(fused.state_dict().items(), per_expert.state_dict().values(), strict=True):
        assert torch.equal(a, b), k


def test_sharded_checkpoint_round_trips(checkpoints: dict, tmp_path: Path) -> None:
    path, _ = checkpoints["qwen2-moe"]
    model = load_hf(path)
    save_hf(model, tmp_path, max_shard_bytes=64 * 1024)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 2
    assert not (tmp_path / "model.safetensors").exists()
    reloaded = load_hf(tmp_path).state_dict()
    assert all(torch.equal(v, reloaded[k]) for k, v in model.state_dict().items())
    hf = AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="eager").eval()
    with torch.no_grad():
        torch.testing.assert_close(hf(ids()).logits, model(ids()), rtol=0, atol=1e-4)


def test_bf16_load(checkpoints: dict) -> None:
    path, _ = checkpoints["qwen3"]
    model = load_hf(path, dtype=torch.bfloat16)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    ref = load_hf(path)(ids()).softmax(-1)
    assert (model(ids()).float().softmax(-1) - ref).abs().max() < 0.05


@pytest.mark.parametrize("name", sorted(name_to_config))
def test_preset_configs_round_trip_through_config_json(name: str, tmp_path: Path) -> None:
    preset = MoEConfig.from_name(name)
    config_to_hf(preset).save_pretrained(tmp_path)
    assert config_from_hf(tmp_path) == dataclasses.replace(preset, name=tmp_path.name)


def test_legacy_config_keys(checkpoints: dict, tmp_path: Path) -> None:
    """Hub configs of transformers 4.x: top-level rope_theta, Qwen3's num_experts."""
    raw = json.loads((checkpoints["qwen3"][0] / "config.json").read_text())
    raw.pop("rope_parameters")
    raw.pop("num_local_experts", None)
    raw |= {"rope_theta": 12345.0, "num_experts": 6, "rope_scaling": None}
    (tmp_path / "config.json").write_text(json.dumps(raw))
    c = config_from_hf(tmp_path)
    assert (c.rope_theta, c.n_experts, c.qk_norm, c.head_dim) == (12345.0, 6, "head", 32)


# ---- errors --------------------------------------------------------------------------------------------------

def copy_checkpoint(src: Path, dst: Path, edit=None) -> Path:
    """Copy a checkpoint, passing its tensors through edit(dict) -> dict."""
    shutil.copy(src / "config.json", dst / "config.json")
    with safe_open(str(src / "model.safetensors"), "pt") as f:
        state = {k: f.get_tensor(k) for k in f.keys()}
    save_file(edit(state) if edit else state, str(dst / "model.safetensors"))
    return dst


def test_missing_tensor_is_named(checkpoints: dict, tmp_path: Path) -> None:
    key = "model.layers.1.mlp.experts.3.up_proj.weight"
    copy_checkpoint(checkpoints["qwen3"][0], tmp_path, lambda s: {k: v for k, v in s.items() if k != key})
    with pytest.raises(CheckpointError, match=f"missing tensor '{key}'"):
        load_hf(tmp_path)


def test_wrong_shape_is_named(checkpoints: dict, tmp_path: Path) -> None:
    key = "model.layers.0.self_attn.k_proj.weight"
    copy_checkpoint(checkpoints["mixtral"][0], tmp_path, lambda s: s | {key: s[key][:-1].clone()})
    with pytest.raises(CheckpointError, match=rf"'{key}' has shape \(31, 64\), expected \(32, 64\)"):
        load_hf(tmp_path)


def test_unexpected_tensor_is_refused(checkpoints: dict, tmp_path: Path) -> None:
    copy_checkpoint(checkpoints["olmoe"][0], tmp_path, lambda s: s | {"model.layers.2.mlp.gate.weight": torch.ones(1)})
    with pytest.raises(CheckpointError, match="unexpected tensors .*model.layers.2.mlp.gate.weight"):
        load_hf(tmp_path)


def test_unsupported_architecture_and_features(checkpoints: dict, tmp_path: Path) -> None:
    raw = json.loads((checkpoints["qwen3"][0] / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(raw | {"architectures": ["LlamaForCausalLM"]}))
    with pytest.raises(CheckpointError, match="unsupported architecture 'LlamaForCausalLM'.*Qwen3MoeForCausalLM"):
        load_hf(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(raw | {"mlp_only_layers": [1]}))
    with pytest.raises(CheckpointError, match="unsupported mlp_only_layers=\\[1\\]"):
        load_hf(tmp_path)


def test_unreadable_files_are_named(checkpoints: dict, tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="missing config: no config.json"):
        load_hf(tmp_path)
    shutil.copy(checkpoints["qwen3"][0] / "config.json", tmp_path / "config.json")
    with pytest.raises(CheckpointError, match="no model.safetensors"):
        load_hf(tmp_path)
    (tmp_path / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00not a header")
    with pytest.raises(CheckpointError, match="cannot read .*model.safetensors"):
        load_hf(tmp_path)
    (tmp_path / "model.safetensors").unlink()
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"a": "shard-1.safetensors"}}))
    with pytest.raises(CheckpointError, match="missing shard .*shard-1.safetensors"):
        load_hf(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="cannot read .*config.json"):
        load_hf(tmp_path)


def test_truncated_file_is_refused(checkpoints: dict, tmp_path: Path) -> None:
    copy_checkpoint(checkpoints["qwen3"][0], tmp_path)
    data = (tmp_path / "model.safetensors").read_bytes()
    (tmp_path / "model.safetensors").write_bytes(data[: len(data) - 1000])
    with pytest.raises(CheckpointError, match="model.safetensors"):
        load_hf(tmp_path)


def test_failed_load_leaves_the_model_unchanged(checkpoints: dict, tmp_path: Path) -> None:
    path, _ = checkpoints["qwen2-moe"]
    model = load_hf(path)
    torch.manual_seed(5)
    model.reset_parameters()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    last = "model.layers.1.mlp.shared_expert.down_proj.weight"  # read after everything else of layer 1
    copy_checkpoint(path, tmp_path, lambda s: s | {last: s[last].T.contiguous()})
    with pytest.raises(CheckpointError, match=last):
        load_hf_weights(model, tmp_path)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    load_hf_weights(model, path)  # the good checkpoint loads in place
    with torch.no_grad():
        torch.testing.assert_close(model(ids()), load_hf(path)(ids()), rtol=0, atol=0)


def test_load_into_a_model_of_another_shape_is_refused(checkpoints: dict) -> None:
    model = Transformer(MoEConfig.from_name("debug-moe"))
    with pytest.raises(CheckpointError, match="does not match the model's config"):
        load_hf_weights(model, checkpoints["qwen3"][0])
