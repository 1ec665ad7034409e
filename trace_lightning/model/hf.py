"""Hugging Face checkpoints <-> ``Transformer``, through one declarative table per family (litgpt style).

The four families differ only in tensor names and in how q/k/v and the experts are split, so each is a
``Family``: a config field map plus a tuple of ``Rule``s, and the same table drives loading, saving and
validation. Hub checkpoints store one tensor per expert (``experts.{j}.gate_proj.weight``, Mixtral
``block_sparse_moe.experts.{j}.w1.weight``); transformers >= 5 fuses them in memory (``experts.gate_up_proj``)
and some tools save that layout, so loading accepts both and ``save_hf`` writes the per-expert one.
A load builds and validates the whole state dict before it touches a model, so a bad file never leaves
a half-loaded model behind.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from trace_lightning.model.checkpoint_files import (
    CheckpointError,
    SafetensorsReader,
    read_json_file,
    write_safetensors,
)
from trace_lightning.model.config import MoEConfig
from trace_lightning.model.hf_compressed import boundary_layers, dequantizing_reader
from trace_lightning.model.model import Transformer

FromHF = Callable[[list[Tensor], MoEConfig], Tensor]
ToHF = Callable[[Tensor, MoEConfig], list[Tensor]]


# ---- transforms: from_hf merges HF tensors into one of ours, to_hf splits it back ------------------------------

def _one(ts: list[Tensor], c: MoEConfig) -> Tensor:
    return ts[0]


def _same(t: Tensor, c: MoEConfig) -> list[Tensor]:
    return [t]


def _cat(ts: list[Tensor], c: MoEConfig) -> Tensor:
    return torch.cat(ts, dim=0)


def _split_qkv(t: Tensor, c: MoEConfig) -> list[Tensor]:
    return list(t.split([c.q_dim, c.kv_dim, c.kv_dim], dim=0))


def _halves(t: Tensor, c: MoEConfig) -> list[Tensor]:
    return list(t.chunk(2, dim=0))


def _stack_gate_up(ts: list[Tensor], c: MoEConfig) -> Tensor:
    """[gate_0, up_0, gate_1, up_1, ...] (I, D) each -> w13 [E, 2I, D]."""
    return torch.stack([torch.cat(ts[j : j + 2], dim=0) for j in range(0, len(ts), 2)])


def _unstack_gate_up(t: Tensor, c: MoEConfig) -> list[Tensor]:
    return [half for w in t.unbind(0) for half in w.chunk(2, dim=0)]


def _stack(ts: list[Tensor], c: MoEConfig) -> Tensor:
    return torch.stack(ts)


def _unstack(t: Tensor, c: MoEConfig) -> list[Tensor]:
    return list(t.unbind(0))


def _always(c: MoEConfig) -> bool:
    return True


@dataclass(frozen=True)
class Rule:
    """One of our tensors and the HF tensors it is made of. ``{i}`` is the layer, ``{j}`` the expert
    (expanded expert-major: all templates for expert 0, then expert 1, ...)."""

    ours: str
    hf: tuple[str, ...]
    from_hf: FromHF = _one
    to_hf: ToHF = _same
    when: Callable[[MoEConfig], bool] = _always

    def hf_keys(self, c: MoEConfig, layer: int) -> list[str]:
        experts = range(c.n_experts) if any("{j}" in t for t in self.hf) else [0]
        return [t.format(i=layer, j=j) for j in experts for t in self.hf]


L = "model.layers.{i}."
EMBEDDINGS = (
    Rule("tok_embeddings.weight", ("model.embed_tokens.weight",)),
    Rule("norm.weight", ("model.norm.weight",)),
    Rule("output.weight", ("lm_head.weight",), when=lambda c: not c.tie_embeddings),
)
ATTENTION = (
    Rule("layers.{i}.attention_norm.weight", (L + "input_layernorm.weight",)),
    Rule("layers.{i}.attn.wqkv.weight",
         (L + "self_attn.q_proj.weight", L + "self_attn.k_proj.weight", L + "self_attn.v_proj.weight"),
         _cat, _split_qkv),
    Rule("layers.{i}.attn.wo.weight", (L + "self_attn.o_proj.weight",)),
    Rule("layers.{i}.ffn_norm.weight", (L + "post_attention_layernorm.weight",)),
)
QK_NORM = (
    Rule("layers.{i}.attn.q_norm.weight", (L + "self_attn.q_norm.weight",)),
    Rule("layers.{i}.attn.k_norm.weight", (L + "self_attn.k_norm.weight",)),
)
QKV_BIAS = (
    Rule("layers.{i}.attn.wqkv.bias",
         (L + "self_attn.q_proj.bias", L + "self_attn.k_proj.bias", L + "self_attn.v_proj.bias"), _cat, _split_qkv),
)
SHARED_EXPERT = (
    Rule("layers.{i}.moe.shared.w13.weight",
         (L + "mlp.shared_expert.gate_proj.weight", L + "mlp.shared_expert.up_proj.weight"), _cat, _halves),
    Rule("layers.{i}.moe.shared.w2.weight", (L + "mlp.shared_expert.down_proj.weight",)),
    Rule("layers.{i}.moe.shared.gate", (L + "mlp.shared_expert_gate.weight",)),
)


def per_expert(block: str, gate: str, up: str, down: str) -> tuple[Rule, ...]:
    """The hub layout: router plus one gate/up/down tensor per expert."""
    p = L + block + "."
    return (
        Rule("layers.{i}.moe.router.weight", (p + "gate.weight",)),
        Rule("layers.{i}.moe.experts.w13", (p + f"experts.{{j}}.{gate}.weight", p + f"experts.{{j}}.{up}.weight"),
             _stack_gate_up, _unstack_gate_up),
        Rule("layers.{i}.moe.experts.w2", (p + f"experts.{{j}}.{down}.weight",), _stack, _unstack),
    )


FUSED_EXPERTS = (  # transformers >= 5 in-memory layout; the same [E, 2I, D] / [E, D, I] as ours
    Rule("layers.{i}.moe.router.weight", (L + "mlp.gate.weight",)),
    Rule("layers.{i}.moe.experts.w13", (L + "mlp.experts.gate_up_proj",)),
    Rule("layers.{i}.moe.experts.w2", (L + "mlp.experts.down_proj",)),
)
QWEN_EXPERTS = per_expert("mlp", "gate_proj", "up_proj", "down_proj")

COMMON_FIELDS = {
    "vocab_size": "vocab_size", "hidden_size": "dim", "num_hidden_layers": "n_layers",
    "num_attention_heads": "n_heads", "num_key_value_heads": "n_kv_heads", "num_experts_per_tok": "top_k",
    "rms_norm_eps": "norm_eps", "max_position_embeddings": "max_seq_len", "tie_word_embeddings": "tie_embeddings",
}


@dataclass(frozen=True)
class Family:
    """A Hugging Face architecture: config field map, constraints, and weight rules."""

    architecture: str
    model_type: str
    fields: dict[str, str]
    """HF config attribute -> MoEConfig field (beyond COMMON_FIELDS)."""
    fixed: dict[str, Any]
    """MoEConfig fields every model of the family has."""
    requires: dict[str, Any]
    """HF config attributes that must have these values (features we do not implement); written on save."""
    rules: tuple[Rule, ...]
    """Non-expert tensors of every layer and the globals."""
    layouts: tuple[tuple[Rule, ...], ...]
    """Alternative router/expert layouts, tried per layer in order; the first is what save_hf writes."""


ROUTED = {"num_experts": "n_experts", "norm_topk_prob": "norm_topk_prob"}
FAMILIES: dict[str, Family] = {f.architecture: f for f in (
    Family(
        "Qwen3MoeForCausalLM", "qwen3_moe",
        fields={"moe_intermediate_size": "moe_intermediate", **ROUTED},
        fixed={"qk_norm": "head"},
        requires={"hidden_act": "silu", "attention_bias": False, "mlp_only_layers": [], "decoder_sparse_step": 1,
                  "use_sliding_window": False},
        rules=EMBEDDINGS + ATTENTION + QK_NORM,
        layouts=(QWEN_EXPERTS, FUSED_EXPERTS),
    ),
    Family(
        "OlmoeForCausalLM", "olmoe",
        fields={"intermediate_size": "moe_intermediate", **ROUTED},
        fixed={"qk_norm": "full"},
        requires={"hidden_act": "silu", "attention_bias": False, "clip_qkv": None},
        rules=EMBEDDINGS + ATTENTION + QK_NORM,
        layouts=(QWEN_EXPERTS, FUSED_EXPERTS),
    ),
    Family(
        "MixtralForCausalLM", "mixtral",
        fields={"intermediate_size": "moe_intermediate", "num_local_experts": "n_experts"},
        fixed={"qk_norm": "none", "norm_topk_prob": True},
        requires={"hidden_act": "silu", "sliding_window": None},
        rules=EMBEDDINGS + ATTENTION,
        layouts=(per_expert("block_sparse_moe", "w1", "w3", "w2"), FUSED_EXPERTS),
    ),
    Family(
        "Qwen2MoeForCausalLM", "qwen2_moe",
        fields={"moe_intermediate_size": "moe_intermediate", **ROUTED,
                "shared_expert_intermediate_size": "shared_intermediate", "qkv_bias": "qkv_bias"},
        fixed={"qk_norm": "none", "n_shared_experts": 1, "shared_expert_gate": True},
        requires={"hidden_act": "silu", "mlp_only_layers": [], "decoder_sparse_step": 1, "use_sliding_window": False},
        rules=EMBEDDINGS + ATTENTION + QKV_BIAS + SHARED_EXPERT,
        layouts=(QWEN_EXPERTS, FUSED_EXPERTS),
    ),
)}


def family_for(architecture: str) -> Family:
    if architecture not in FAMILIES:
        raise CheckpointError(f"unsupported architecture {architecture!r}; supported: {', '.join(FAMILIES)}")
    return FAMILIES[architecture]


# ---- config ------------------------------------------------------------------------------------------------------

def _read_config_json(path: Path) -> dict[str, Any]:
    file = path / "config.json"
    if not file.exists():
        raise CheckpointError(f"missing config: no config.json in {path}")
    return read_json_file(file, "config", CheckpointError)


def config_from_hf(path: str | Path) -> MoEConfig:
    """Read a checkpoint folder's config.json into a MoEConfig (through transformers' config class, which
    normalises legacy keys such as a top-level ``rope_theta``). Any malformed value is a CheckpointError
    naming the file."""
    path = Path(path)
    raw = _read_config_json(path)
    try:
        return _config_from_raw(path, raw)
    except CheckpointError:
        raise
    except Exception as e:  # transformers and huggingface_hub raise many types for bad values
        raise CheckpointError(f"{path / 'config.json'}: malformed config: {' '.join(str(e).split())}") from e


def _architecture(raw: dict[str, Any]) -> str:
    architectures = raw.get("architectures")
    if architectures is not None and not (isinstance(architectures, list) and
                                          all(isinstance(a, str) for a in architectures)):
        raise ValueError(f"'architectures' must be a list of names, got {architectures!r}")
    if architectures:
        return architectures[0]
    model_type = raw.get("model_type")
    return next((f.architecture for f in FAMILIES.values() if f.model_type == model_type), str(model_type))


def _config_from_raw(path: Path, raw: dict[str, Any]) -> MoEConfig:
    from transformers import AutoConfig

    architecture = _architecture(raw)
    family = family_for(architecture)
    hf = AutoConfig.for_model(**raw)
    for key, value in family.requires.items():
        if getattr(hf, key, value) != value:
            raise CheckpointError(f"{path / 'config.json'}: unsupported {key}={getattr(hf, key)!r} "
                                  f"(only {value!r} is implemented for {architecture})")
    rope = getattr(hf, "rope_parameters", None) or {"rope_type": "default", "rope_theta": hf.rope_theta}
    if rope.get("rope_type", "default") != "default":
        raise CheckpointError(f"{path / 'config.json'}: unsupported rope type {rope['rope_type']!r}")
    values = {ours: getattr(hf, key) for key, ours in {**COMMON_FIELDS, **family.fields}.items()}
    values["n_kv_heads"] = values["n_kv_heads"] or values["n_heads"]
    values.update(boundary_layers(path, raw, values["n_layers"]))  # an exported FP4 policy's bf16 layers
    head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
    try:
        config = MoEConfig(name=path.name, hf_architecture=architecture, head_dim=head_dim,
                           rope_theta=float(rope["rope_theta"]), **values, **family.fixed)
        _check_head_dim(family, config)
    except ValueError as e:
        raise CheckpointError(f"{path / 'config.json'}: {e}") from e
    return config


def _check_head_dim(family: Family, c: MoEConfig) -> None:
    if family.model_type == "olmoe" and c.q_dim != c.dim:
        raise CheckpointError(f"OLMoE needs n_heads * head_dim == dim (its q/k norms span hidden_size), got "
                              f"{c.n_heads} * {c.head_dim} != {c.dim}")


def config_to_hf(config: MoEConfig, dtype: torch.dtype = torch.float32) -> Any:
    """The transformers config (``PretrainedConfig``) that ``save_hf`` writes for ``config``."""
    from transformers import AutoConfig

    family = family_for(config.hf_architecture)
    _check_head_dim(family, config)
    values = {key: getattr(config, ours) for key, ours in {**COMMON_FIELDS, **family.fields}.items()}
    rope = {"rope_type": "default", "rope_theta": config.rope_theta}
    return AutoConfig.for_model(family.model_type, architectures=[family.architecture], rope_parameters=rope,
                                head_dim=config.head_dim, dtype=str(dtype).removeprefix("torch."),
                                **family.requires, **values)


# ---- reading -----------------------------------------------------------------------------------------------------

def _layer_rules(family: Family, c: MoEConfig) -> Iterator[tuple[int, Rule]]:
    """(layer, rule) for the non-expert rules; layer -1 marks a global tensor."""
    for rule in family.rules:
        if rule.when(c):
            layers = range(c.n_layers) if "{i}" in rule.ours else [-1]
            yield from ((i, rule) for i in layers)


def _expected_shapes(c: MoEConfig) -> dict[str, torch.Size]:
    with torch.device("meta"):
        return {k: v.shape for k, v in Transformer(c).state_dict().items()}


def _convert(rule: Rule, layer: int, reader: SafetensorsReader, c: MoEConfig,
             expected: dict[str, torch.Size]) -> tuple[str, Tensor, list[str]]:
    """Read and shape-check a rule's HF tensors, return (our key, tensor, HF keys used)."""
    ours = rule.ours.format(i=layer)
    keys = rule.hf_keys(c, layer)
    want = [t.shape for t in rule.to_hf(torch.empty(expected[ours], device="meta"), c)]
    tensors = []
    for key, shape in zip(keys, want, strict=True):
        t = reader.get(key)
        if t.shape != shape:
            raise CheckpointError(f"tensor {key!r} has shape {tuple(t.shape)}, expected {tuple(shape)} for {c.name}")
        _check_values(key, t)
        tensors.append(t.float() if t.element_size() == 1 else t)  # float8: torch.cat has no float8 promotion
    return ours, rule.from_hf(tensors, c), keys


def _check_values(key: str, t: Tensor) -> None:
    """Weights are floats and finite: an int or bool tensor cast to float, or a NaN that attention zeroes into
    finite logits, would be garbage that no later check notices."""
    if not t.is_floating_point():
        raise CheckpointError(f"tensor {key!r} has dtype {t.dtype}; weights must be floating point")
    wide = t.to(torch.bfloat16) if t.element_size() == 1 else t  # isfinite has no float8 kernel; bf16 holds them all
    if not bool(torch.isfinite(wide).all()):
        raise CheckpointError(f"tensor {key!r} holds {int((~torch.isfinite(wide)).sum())} non-finite (NaN or inf) "
                              f"values (dtype {t.dtype})")


def _check_declared_size(path: Path, reader: SafetensorsReader, c: MoEConfig) -> None:
    """Refuse a config that declares far more parameters than the files hold before building even a meta model
    (10^6 layers or 10^9 experts would otherwise allocate module trees and key lists for a minute). A few
    missing tensors pass here and are named one by one by the per-tensor checks."""
    held = reader.num_elements()
    if c.num_parameters() > 2 * held:
        raise CheckpointError(f"{path / 'config.json'} declares {c.num_parameters():,} parameters ({c.n_layers} "
                              f"layers, {c.n_experts} experts) but the safetensors in {path} hold {held:,}")


def _pick_layout(family: Family, reader: SafetensorsReader, c: MoEConfig, layer: int) -> tuple[Rule, ...]:
    for layout in family.layouts:
        if all(k in reader for rule in layout for k in rule.hf_keys(c, layer)):
            return layout
    return family.layouts[0]  # reading it names the first missing tensor


def load_hf_state_dict(path: str | Path, config: MoEConfig, dtype: torch.dtype = torch.float32,
                       device: str | torch.device = "cpu") -> dict[str, Tensor]:
    """Our complete, validated state dict from a checkpoint folder (raises ``CheckpointError`` on any problem)."""
    path = Path(path)
    family = family_for(config.hf_architecture)
    raw = SafetensorsReader(path)
    _check_declared_size(path, raw, config)  # counts stored elements: FP4 exports hold about half per weight
    reader = dequantizing_reader(raw, path)  # FP4 Linears read as dense weights
    expected = _expected_shapes(config)
    jobs = list(_layer_rules(family, config))
    jobs += [(i, rule) for i in range(config.n_layers) for rule in _pick_layout(family, reader, config, i)]
    state, used = {}, set()
    for layer, rule in jobs:
        ours, tensor, keys = _convert(rule, layer, reader, config, expected)
        state[ours] = tensor.to(device=device, dtype=dtype)
        used.update(keys)
    if config.tie_embeddings:
        state["output.weight"] = state["tok_embeddings.weight"]
        used.add("lm_head.weight")
    unexpected = sorted(k for k in reader.keys() - used if not k.endswith("rotary_emb.inv_freq"))
    if unexpected:
        raise CheckpointError(f"{len(unexpected)} unexpected tensors in {path} (e.g. {unexpected[0]!r}); "
                              "the checkpoint does not match its config")
    missing = set(expected) - set(state)
    assert not missing, f"weight map of {family.architecture} does not cover {sorted(missing)}"
    return state


def load_hf(path: str | Path, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu") -> Transformer:
    """Build a ``Transformer`` from a Hugging Face checkpoint folder (config.json + safetensors)."""
    config = config_from_hf(path)
    state = load_hf_state_dict(path, config, dtype=dtype, device=device)
    with torch.device("meta"):
        model = Transformer(config)
    model.load_state_dict(state, assign=True, strict=True)
    model.tie_weights()
    return model


_CONFIG_FIELDS_THAT_MATTER = ("hf_architecture", "vocab_size", "dim", "n_layers", "n_heads", "n_kv_heads", "head_dim",
                              "moe_intermediate", "n_experts", "top_k", "norm_topk_prob", "router", "n_shared_experts",
                              "shared_intermediate", "shared_expert_gate", "qkv_bias", "qk_norm", "rope_theta",
                              "norm_eps", "tie_embeddings")


@torch.no_grad()
def load_hf_weights(model: Transformer, path: str | Path) -> None:
    """Copy a checkpoint's weights into ``model`` in place; all-or-nothing (the model is untouched on error)."""
    ckpt = config_from_hf(path)
    diff = [f for f in _CONFIG_FIELDS_THAT_MATTER if getattr(ckpt, f) != getattr(model.config, f)]
    if diff:
        raise CheckpointError(f"checkpoint {path} does not match the model's config in {diff}")
    params = model.state_dict()
    state = load_hf_state_dict(path, model.config, dtype=params["norm.weight"].dtype,
                               device=params["norm.weight"].device)
    for key, p in params.items():
        p.copy_(state[key])


# ---- writing -----------------------------------------------------------------------------------------------------

def to_hf_state_dict(model: Transformer) -> dict[str, Tensor]:
    """HF-named tensors in the hub layout (per-expert), as independent contiguous CPU tensors."""
    c = model.config
    family = family_for(c.hf_architecture)
    ours = model.state_dict()
    jobs = list(_layer_rules(family, c)) + [(i, rule) for i in range(c.n_layers) for rule in family.layouts[0]]
    out = {}
    for layer, rule in jobs:
        tensors = rule.to_hf(ours[rule.ours.format(i=layer)].detach(), c)
        out.update({k: t.to("cpu").contiguous().clone() for k, t in zip(rule.hf_keys(c, layer), tensors, strict=True)})
    return out


def save_hf(model: Transformer, path: str | Path, max_shard_bytes: int = 5 * 2**30) -> None:
    """Write config.json and safetensors (sharded with an index above ``max_shard_bytes``) that
    ``transformers.AutoModelForCausalLM.from_pretrained`` loads."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    config_to_hf(model.config, model.norm.weight.dtype).save_pretrained(str(path))
    write_safetensors(to_hf_state_dict(model), path, max_shard_bytes)
