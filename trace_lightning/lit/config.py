"""Typed settings of the RL run; LightningCLI turns the field docstrings into `--help` text."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class TraceConfig:
    """How rollout and training quantize, and how the record guides training."""

    method: str = "trace_compact"
    """bf16 | fp4_naive | fp4_qat | fp4_qat_tis | trace | trace_compact (docs/design.md, Methods)."""
    fmt: str = "nvfp4"
    """FP4 format: nvfp4 | mxfp4 | mxfp4:rceil."""
    layers: str | None = None
    """Guidance layer policy (all, none, last:K, deep:F, budget:BYTES, auto); None takes the method's default."""
    route_replay: bool = False
    """Training uses the rollout's routed experts (gate weights still from training's router)."""
    audit_every: int = 10
    """Every N steps keep full records of all layers for code/value agreement metrics (0 disables)."""
    rollout_compute: str = "bf16"
    """Compute dtype of the rollout engine (bf16 models a production engine whose kernels differ)."""
    backend: str = "auto"
    """Kernel backend of the rollout engine: auto | triton | sim."""
    cuda_graph: bool = True
    """On GPU, replay the engine's decode step as a CUDA graph (false: eager steps, e.g. to profile)."""


@dataclass
class RolloutConfig:
    """What each RL step generates."""

    prompts_per_step: int = 16
    """Distinct prompts per step."""
    group_size: int = 4
    """Samples per prompt (the GRPO group)."""
    max_new_tokens: int = 6
    """Response length cap."""
    temperature: float = 1.0
    """Sampling temperature (logprobs on both sides are taken at this temperature)."""
    top_k: int = 0
    """Top-k truncation of sampling (0: off); logprobs stay untruncated."""
    top_p: float = 1.0
    """Top-p truncation of sampling (1.0: off)."""


@dataclass
class RLConfig:
    """The policy-gradient objective."""

    advantage: str = "grpo"
    """Advantage estimator: grpo | rloo | dr_grpo."""
    loss: str = "ppo_clip"
    """Policy loss from the rl registry."""
    loss_agg: str = "token_mean"
    """Aggregation: token_mean | seq_mean_token_mean | seq_mean_token_sum."""
    clip_eps: float = 0.2
    """PPO clip range."""
    kl_coef: float = 0.0
    """KL-to-reference penalty (k3); 0 disables it."""
    tis_cap: float = 2.0
    """Truncation of the importance weight for tis."""
    correction: str | None = None
    """Mismatch correction none | tis | mis; None takes the method's default."""
