"""MoE model config: one dataclass plus named presets (litgpt style).

Every field has a docstring so LightningCLI ``--help`` explains it. Presets hold the real shapes of the
families we load from Hugging Face, so a preset and a converted checkpoint build the same module tree.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Literal

MAX_EXPERTS = 2**15
"""Routes travel as int16 expert ids (guidance.record.compact_routes)."""
QKNorm = Literal["none", "head", "full"]
RouterKind = Literal["softmax", "sigmoid"]


@dataclass
class MoEConfig:
    """Shape and routing of a decoder-only MoE transformer (every layer is MoE)."""

    name: str = "custom"
    """Preset name, for logs and checkpoints."""
    hf_architecture: str = "Qwen3MoeForCausalLM"
    """Hugging Face architecture this config converts to and from (the family of the weight map)."""
    vocab_size: int = 128
    """Number of token ids (rows of the embedding and of the lm_head)."""
    dim: int = 128
    """Residual stream width D."""
    n_layers: int = 4
    """Number of transformer blocks."""
    n_heads: int = 4
    """Query heads Hq."""
    n_kv_heads: int = 2
    """Key/value heads Hkv (grouped-query attention); must divide n_heads."""
    head_dim: int = 32
    """Per-head width Dh; need not equal dim / n_heads (Qwen3)."""
    moe_intermediate: int = 64
    """Hidden width I of each routed expert's SwiGLU MLP."""
    n_experts: int = 8
    """Routed experts E per layer."""
    top_k: int = 2
    """Experts each token is routed to."""
    norm_topk_prob: bool = True
    """Renormalise the top-k gate weights to sum to 1 (Qwen3, Mixtral); False keeps raw probabilities (OLMoE)."""
    router: RouterKind = "softmax"
    """Router score function over expert logits, computed in fp32: ``softmax`` (all families here) or ``sigmoid``."""
    n_shared_experts: int = 0
    """Always-on shared experts fused into one MLP of width ``shared_intermediate`` (Qwen2-MoE: 1)."""
    shared_intermediate: int = 0
    """Total hidden width of the shared-expert MLP; required when n_shared_experts > 0."""
    shared_expert_gate: bool = False
    """Scale the shared expert's output by sigmoid(x @ w_gate) per token (Qwen2-MoE)."""
    qkv_bias: bool = False
    """Bias on the q/k/v projections (Qwen2-MoE)."""
    qk_norm: QKNorm = "head"
    """RMSNorm on q and k before RoPE: ``head`` per head over Dh (Qwen3), ``full`` over the whole projection
    (OLMoE), or ``none`` (Mixtral, Qwen2-MoE)."""
    rope_theta: float = 10000.0
    """RoPE base frequency (rotate-half convention, as in Hugging Face)."""
    norm_eps: float = 1e-6
    """Epsilon of every RMSNorm."""
    max_seq_len: int = 4096
    """Longest sequence (prompt + response) the model is used with; sizes the rollout KV cache."""
    tie_embeddings: bool = False
    """Share the embedding matrix with the lm_head."""
    bf16_first_layers: int = 0
    """First layers that stay unquantized (the hook is not called there)."""
    bf16_last_layers: int = 0
    """Last layers that stay unquantized (the hook is not called there)."""
    init_std: float = 0.02
    """Std of the normal init of every matrix (norms start at 1, biases at 0)."""

    def __post_init__(self) -> None:
        positive = ("vocab_size", "dim", "n_layers", "n_heads", "n_kv_heads", "head_dim", "moe_intermediate",
                    "n_experts", "top_k", "max_seq_len")
        for field in positive:
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, int):
                raise ValueError(f"MoEConfig.{field} must be an integer, got {value!r}")
            if value <= 0:
                raise ValueError(f"MoEConfig.{field} must be positive, got {value}")
        for field in ("n_shared_experts", "shared_intermediate", "bf16_first_layers", "bf16_last_layers"):
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, int):
                raise ValueError(f"MoEConfig.{field} must be an integer, got {value!r}")
        for field in ("norm_topk_prob", "shared_expert_gate", "qkv_bias", "tie_embeddings"):
            if not isinstance(getattr(self, field), bool):
                raise ValueError(f"MoEConfig.{field} must be true or false, got {getattr(self, field)!r}")
        for field, allow_zero in (("rope_theta", False), ("norm_eps", False), ("init_std", True)):
            value = getattr(self, field)
            number = isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
            if not number or value < 0 or (value == 0 and not allow_zero):
                raise ValueError(f"MoEConfig.{field} must be a finite number {'>=' if allow_zero else '>'} 0, "
                                 f"got {value!r}")
        if self.n_experts > MAX_EXPERTS:
            raise ValueError(f"MoEConfig.n_experts must be <= {MAX_EXPERTS} (records store expert ids as int16), "
                             f"got {self.n_experts}")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"n_heads ({self.n_heads}) must be a multiple of n_kv_heads ({self.n_kv_heads})")
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for RoPE, got {self.head_dim}")
        if self.top_k > self.n_experts:
            raise ValueError(f"top_k ({self.top_k}) must be <= n_experts ({self.n_experts})")
        if self.qk_norm not in ("none", "head", "full"):
            raise ValueError(f"qk_norm must be 'none', 'head' or 'full', got {self.qk_norm!r}")
        if self.router not in ("softmax", "sigmoid"):
            raise ValueError(f"router must be 'softmax' or 'sigmoid', got {self.router!r}")
        if self.n_shared_experts < 0 or (self.n_shared_experts > 0) != (self.shared_intermediate > 0):
            raise ValueError("n_shared_experts > 0 and shared_intermediate > 0 go together "
                             f"(got {self.n_shared_experts} and {self.shared_intermediate})")
        if self.shared_expert_gate and not self.n_shared_experts:
            raise ValueError("shared_expert_gate needs a shared expert (n_shared_experts > 0)")
        if min(self.bf16_first_layers, self.bf16_last_layers) < 0:
            raise ValueError("bf16_first_layers and bf16_last_layers must be >= 0")
        if self.bf16_first_layers + self.bf16_last_layers > self.n_layers:
            raise ValueError(f"bf16 boundary ({self.bf16_first_layers} first + {self.bf16_last_layers} last) "
                             f"exceeds n_layers ({self.n_layers})")

    @property
    def q_dim(self) -> int:
        """Width of the query projection, Hq * Dh."""
        return self.n_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        """Width of the key (and of the value) projection, Hkv * Dh."""
        return self.n_kv_heads * self.head_dim

    def num_parameters(self) -> int:
        """Parameters of the Transformer this config builds, by arithmetic: a checkpoint loader compares it
        with the tensors on disk before building anything (a config that declares 10^9 experts is refused
        in microseconds instead of allocating for a minute)."""
        D, E, I, S = self.dim, self.n_experts, self.moe_intermediate, self.shared_intermediate
        qkv = self.q_dim + 2 * self.kv_dim
        qk_norm = {"none": 0, "head": 2 * self.head_dim, "full": self.q_dim + self.kv_dim}[self.qk_norm]
        shared = 3 * S * D + (D if self.shared_expert_gate else 0) if self.n_shared_experts else 0
        layer = 2 * D + qkv * D + (qkv if self.qkv_bias else 0) + self.q_dim * D + qk_norm + E * D + 3 * E * I * D
        embeddings = self.vocab_size * D * (1 if self.tie_embeddings else 2) + D
        return embeddings + self.n_layers * (layer + shared)

    def is_quantized_layer(self, layer: int) -> bool:
        """False for the bf16 boundary layers, where the model skips the quantization hook."""
        return self.bf16_first_layers <= layer < self.n_layers - self.bf16_last_layers

    @classmethod
    def from_name(cls, name: str, **overrides: Any) -> MoEConfig:
        """Build a preset by name; keyword overrides replace fields (and are validated)."""
        if name not in name_to_config:
            raise ValueError(f"unknown model preset {name!r}; known presets: {', '.join(sorted(name_to_config))}")
        unknown = set(overrides) - {f.name for f in dataclasses.fields(cls)}
        if unknown:
            raise ValueError(f"unknown MoEConfig fields {sorted(unknown)}")
        return cls(**{**name_to_config[name], **overrides})


configs: list[dict[str, Any]] = [
    # ~1M parameters: CPU tests and the simulator. Dims are multiples of 32 so MXFP4 blocks tile every row.
    dict(name="debug-moe", vocab_size=128, dim=128, n_layers=4, n_heads=4, n_kv_heads=2, head_dim=32,
         moe_intermediate=64, n_experts=8, top_k=2, norm_topk_prob=True, qk_norm="head", max_seq_len=512),
    # ~190M total / ~58M active: single-GPU RL experiments with Qwen3-style blocks.
    dict(name="small-moe", vocab_size=32768, dim=512, n_layers=8, n_heads=8, n_kv_heads=2, head_dim=64,
         moe_intermediate=384, n_experts=32, top_k=4, norm_topk_prob=True, qk_norm="head", rope_theta=1e6,
         max_seq_len=4096),
    # ~1.76B total / ~0.35B active: the rollout-dominated GPU fit (conf/gpu_long.yaml), a Qwen3-MoE block at OLMoE's
    # expert count, small enough to train with AdamW on one 80 GB card, large enough that decoding reads GBs a step.
    dict(name="medium-moe", vocab_size=32768, dim=1024, n_layers=16, n_heads=16, n_kv_heads=4, head_dim=128,
         moe_intermediate=512, n_experts=64, top_k=8, norm_topk_prob=True, qk_norm="head", rope_theta=1e6,
         max_seq_len=8192),
    # https://huggingface.co/Qwen/Qwen3-30B-A3B/blob/main/config.json
    dict(name="qwen3-30b-a3b", vocab_size=151936, dim=2048, n_layers=48, n_heads=32, n_kv_heads=4, head_dim=128,
         moe_intermediate=768, n_experts=128, top_k=8, norm_topk_prob=True, qk_norm="head", rope_theta=1e6,
         norm_eps=1e-6, max_seq_len=40960),
    # https://huggingface.co/allenai/OLMoE-1B-7B-0924/blob/main/config.json
    dict(name="olmoe-1b-7b", hf_architecture="OlmoeForCausalLM", vocab_size=50304, dim=2048, n_layers=16,
         n_heads=16, n_kv_heads=16, head_dim=128, moe_intermediate=1024, n_experts=64, top_k=8,
         norm_topk_prob=False, qk_norm="full", rope_theta=10000.0, norm_eps=1e-5, max_seq_len=4096),
    # https://huggingface.co/mistralai/Mixtral-8x7B-v0.1/blob/main/config.json
    dict(name="mixtral-8x7b", hf_architecture="MixtralForCausalLM", vocab_size=32000, dim=4096, n_layers=32,
         n_heads=32, n_kv_heads=8, head_dim=128, moe_intermediate=14336, n_experts=8, top_k=2,
         norm_topk_prob=True, qk_norm="none", rope_theta=1e6, norm_eps=1e-5, max_seq_len=32768),
    # https://huggingface.co/Qwen/Qwen1.5-MoE-A2.7B/blob/main/config.json
    dict(name="qwen2-moe-a2.7b", hf_architecture="Qwen2MoeForCausalLM", vocab_size=151936, dim=2048, n_layers=24,
         n_heads=16, n_kv_heads=16, head_dim=128, moe_intermediate=1408, n_experts=60, top_k=4,
         norm_topk_prob=False, n_shared_experts=1, shared_intermediate=5632, shared_expert_gate=True,
         qkv_bias=True, qk_norm="none", rope_theta=1e6, norm_eps=1e-6, max_seq_len=8192),
]

name_to_config: dict[str, dict[str, Any]] = {c["name"]: c for c in configs}
