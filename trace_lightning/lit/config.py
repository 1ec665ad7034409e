"""Typed settings of the RL run; LightningCLI turns the field docstrings into `--help` text.

Each config checks its values when it is built, so a bad setting stops the run before the warm start with
a one-line error that names the field and lists the valid choices, instead of at the first RL step.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Literal

from trace_lightning.guidance.compaction import parse_layer_policy
from trace_lightning.methods import METHODS
from trace_lightning.model.hooks import SITES
from trace_lightning.ops import BACKENDS
from trace_lightning.quant import parse_format
from trace_lightning.rl import ADVANTAGES, AGG_MODES, CORRECTIONS, POLICY_LOSSES

FORMAT_NAMES = ("nvfp4", "nvfp4:none", "mxfp4", "mxfp4:floor", "mxfp4:rceil")
COMPUTE_DTYPES = ("bf16", "bfloat16", "fp32", "float32")


class NoLearningSignalWarning(UserWarning):
    """Settings under which every group's samples get the same reward, so group advantages are all zero."""


def check_choice(field: str, value: Any, choices: Iterable[str]) -> None:
    """ValueError naming the field and listing the choices unless value is one of them."""
    choices = list(choices)
    if value not in choices:
        raise ValueError(f"unknown {field} {value!r}; expected one of: {', '.join(choices)}")


def check_int(field: str, value: Any, low: int) -> None:
    """ValueError unless value is an int (not a bool) >= low."""
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"{field} must be an integer >= {low}, got {value!r}")


def check_real(field: str, value: Any, low: float, *, low_open: bool = False, high: float = math.inf) -> None:
    """ValueError unless value is a finite number in [low, high] (or (low, high] when low_open)."""
    ok = isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
    ok = ok and (value > low if low_open else value >= low) and value <= high
    if not ok:
        bound = f"{'>' if low_open else '>='} {low}" + (f" and <= {high}" if math.isfinite(high) else "")
        raise ValueError(f"{field} must be a finite number {bound}, got {value!r}")


@dataclass
class TraceConfig:
    """How rollout and training quantize, and how the record guides training."""

    method: str = "trace_compact"
    """bf16 | fp4_naive | fp4_qat | fp4_qat_tis | fp4_qat_icepop | trace | trace_compact (docs/design.md, Methods)."""
    fmt: str = "nvfp4"
    """FP4 format: nvfp4 | mxfp4 | mxfp4:rceil."""
    layers: str | None = None
    """Guidance layer policy (all, none, last:K, deep:F, budget:BYTES, auto); None takes the method's default."""
    records_on_host: bool | Literal["auto"] = "auto"
    """Stream the rollout's records to host memory while decoding (device memory then stays bounded however long
    the responses; training copies each batch's record back to the device). auto: stream a rollout's record when,
    kept on the GPU, it would take more than a quarter of the device's free memory or a twentieth of all of it
    (lit/record_placement.py)."""
    sites: list[str] | None = None
    """Activation sites the record keeps in the chosen layers (attn_in, k, v, attn_out, moe_in, moe_down,
    shared_down); None: all. Unrecorded sites round to nearest on their own scales, as fp4_qat does."""
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
    keep_decode_graph: bool = True
    """With cuda_graph: keep the captured decode step, its KV cache and record buffers between rollouts, so each
    rollout replays from its first step (false: free them after every rollout, for memory training needs)."""

    def __post_init__(self) -> None:
        check_choice("trace.method", self.method, METHODS)
        try:
            parse_format(self.fmt)
        except ValueError:
            raise ValueError(f"unknown trace.fmt {self.fmt!r}; expected one of: {', '.join(FORMAT_NAMES)}") from None
        if self.layers is not None:
            try:
                parse_layer_policy(self.layers)
            except ValueError as err:
                raise ValueError(f"trace.layers: {err}") from None
        if self.sites is not None:
            unknown = [s for s in self.sites if s not in SITES]
            if unknown or not self.sites:
                raise ValueError(f"trace.sites: unknown sites {unknown} (or an empty list); expected some of: "
                                 f"{', '.join(SITES)}")
        if self.records_on_host not in (True, False, "auto"):
            raise ValueError(f"trace.records_on_host must be true, false or auto, got {self.records_on_host!r}")
        check_int("trace.audit_every", self.audit_every, 0)
        check_choice("trace.rollout_compute", self.rollout_compute, COMPUTE_DTYPES)
        check_choice("trace.backend", self.backend, BACKENDS)


@dataclass
class RolloutConfig:
    """What each RL step generates."""

    prompts_per_step: int = 16
    """Distinct prompts per step."""
    group_size: int = 4
    """Samples per prompt (the GRPO group)."""
    max_new_tokens: int = 6
    """Response length cap."""
    min_new_tokens: int = 0
    """RL rollouts sample no stop token before this many response tokens (vLLM's min_tokens; evaluation is not
    held back): long, fixed-length responses for a rollout-dominated step, e.g. conf/gpu_long.yaml."""
    temperature: float = 1.0
    """Sampling temperature (logprobs on both sides are taken at this temperature)."""
    top_k: int = 0
    """Top-k truncation of sampling (0: off); logprobs stay untruncated."""
    top_p: float = 1.0
    """Top-p truncation of sampling (1.0: off)."""
    max_batch: int | None = None
    """Decode at most this many sequences at once, refilling a slot with the next rollout as soon as its
    sequence ends (continuous batching); None: all prompts_per_step x group_size rollouts as one batch."""
    prefill_chunk: int | None = None
    """Prefill prompts this many positions a forward (bounds the prefill's memory for long prompts; the sequences
    are the same); None: each prefill in one forward."""
    env_timeout_s: float = 30.0
    """Multi-turn tasks: an env reply that takes longer ends its episode (reward 0)."""
    env_replies: Literal["in_order", "as_ready"] = "in_order"
    """Multi-turn tasks: in_order takes every reply asked after a forward before the next one, so reruns give the
    same episodes bit for bit; as_ready feeds each reply when it comes (a slow env holds up only its own episode,
    but which rows share a forward, and so their logits, then depends on the env's timing). rollout/turns.py."""

    def __post_init__(self) -> None:
        for name in ("prompts_per_step", "group_size", "max_new_tokens"):
            check_int(f"rollout.{name}", getattr(self, name), 1)
        check_int("rollout.min_new_tokens", self.min_new_tokens, 0)
        if self.min_new_tokens > self.max_new_tokens:
            raise ValueError(f"rollout.min_new_tokens ({self.min_new_tokens}) exceeds rollout.max_new_tokens "
                             f"({self.max_new_tokens})")
        if self.max_batch is not None:
            check_int("rollout.max_batch", self.max_batch, 1)
        if self.prefill_chunk is not None:
            check_int("rollout.prefill_chunk", self.prefill_chunk, 1)
        check_real("rollout.temperature", self.temperature, 0.0)
        check_real("rollout.env_timeout_s", self.env_timeout_s, 0.0, low_open=True)
        check_choice("rollout.env_replies", self.env_replies, ("in_order", "as_ready"))
        check_int("rollout.top_k", self.top_k, 0)
        check_real("rollout.top_p", self.top_p, 0.0, low_open=True, high=1.0)
        if self.group_size == 1:
            warnings.warn("rollout.group_size is 1: each group holds one sample, so every group advantage is 0 "
                          "and RL learns nothing; use group_size >= 2", NoLearningSignalWarning, stacklevel=3)
        if self.temperature == 0:
            warnings.warn("rollout.temperature is 0 (greedy): the samples of a group are identical, so every group "
                          "advantage is 0 and RL learns nothing; use a temperature > 0", NoLearningSignalWarning,
                          stacklevel=3)


@dataclass
class RLConfig:
    """The policy-gradient objective."""

    advantage: str = "grpo"
    """Advantage estimator: grpo | rloo | dr_grpo (rl advantage registry)."""
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
    icepop_bound: float = 2.0
    """icepop: tokens whose rollout importance ratio leaves [1/icepop_bound, icepop_bound] carry no gradient."""
    correction: str | None = None
    """Mismatch correction none | tis | mis | icepop; None takes the method's default."""

    def __post_init__(self) -> None:
        check_choice("rl.advantage", self.advantage, ADVANTAGES)
        check_choice("rl.loss", self.loss, POLICY_LOSSES)
        check_choice("rl.loss_agg", self.loss_agg, AGG_MODES)
        if self.correction is not None:
            check_choice("rl.correction", self.correction, CORRECTIONS)
        check_real("rl.clip_eps", self.clip_eps, 0.0)
        check_real("rl.kl_coef", self.kl_coef, 0.0)
        check_real("rl.tis_cap", self.tis_cap, 0.0, low_open=True)
        check_real("rl.icepop_bound", self.icepop_bound, 1.0, low_open=True)


def check_run_args(rl: RLConfig, rollout: RolloutConfig, *, lr: float, warmup_lr: float, warmup_steps: int,
                   micro_batch_size: int | None = None, cpu_threads: int = 0) -> None:
    """The checks that span configs, and the module's own numbers: all before any weight is built."""
    check_int("cpu_threads", cpu_threads, 0)
    if micro_batch_size is not None:
        check_int("micro_batch_size", micro_batch_size, 1)
    if rl.advantage == "rloo" and rollout.group_size < 2:
        raise ValueError(f"rl.advantage 'rloo' needs rollout.group_size >= 2, got {rollout.group_size}")
    check_real("lr", lr, 0.0, low_open=True)
    check_real("warmup_lr", warmup_lr, 0.0, low_open=True)
    check_int("warmup_steps", warmup_steps, 0)
