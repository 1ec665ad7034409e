"""What goes into and comes out of the rollout engine: sampling settings, what to record, and the batch.

Alignment of per-position outputs (routes, captures): row t holds what the engine computed at token
position t of prompt + response, for t = 0 .. T_b - 2 where T_b = len(prompt) + len(response). These are
exactly the positions the engine fed through the model (the last sampled token is never fed back), and
exactly the input positions of the training forward over tokens[:-1], so rows line up with it one to one.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

from torch import Tensor

from trace_lightning.guidance.record import BatchRecord
from trace_lightning.model.hooks import SITES
from trace_lightning.quant import BlockFP4

SiteKey = tuple[int, str]
FinishReason = Literal["stop", "length"]


@dataclass(frozen=True)
class SamplingParams:
    """How each sequence is sampled; logprobs are always over the full, untruncated vocabulary."""

    max_new_tokens: int | Sequence[int] = 64
    """Response length cap: one value for all prompts, or one per prompt."""
    temperature: float = 1.0
    """Softmax temperature; 0 is greedy decoding (and its logprobs are the unscaled ones)."""
    top_k: int = 0
    """Sample among the k most likely tokens only (0: off). Does not change the reported logprobs."""
    top_p: float = 1.0
    """Sample from the smallest set of tokens with mass >= top_p (1.0: off). Does not change logprobs."""
    seed: int | Sequence[int] = 0
    """One seed for the batch (sequence i uses ``sequence_seeds(seed, n)[i]``) or one seed per prompt."""
    stop_token_ids: Sequence[int] = ()
    """A sampled stop token ends its sequence (and is kept as its last response token)."""
    min_new_tokens: int = 0
    """No stop token is sampled before this many response tokens (vLLM's min_tokens): fixed-length responses for
    throughput runs. Sampling only: the reported logprobs stay the full distribution's."""

    def __post_init__(self) -> None:
        if not 0 <= self.temperature < math.inf:  # NaN fails this too
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if isinstance(self.min_new_tokens, bool) or not isinstance(self.min_new_tokens, int) or self.min_new_tokens < 0:
            raise ValueError(f"min_new_tokens must be an integer >= 0, got {self.min_new_tokens!r}")


@dataclass(frozen=True)
class CaptureSpec:
    """Which (layer, site) pairs the rollout records, and in which mode."""

    layers: set[int] | frozenset[int] | Literal["all"] = "all"
    """Layers to record; boundary (bf16) layers have no FP4 activations and are skipped."""
    sites: Sequence[str] | Literal["all"] = "all"
    """Activation sites to record (see ``trace_lightning.model.hooks.SITES``)."""
    mode: Literal["full", "parity"] = "full"
    """What the engine records per element: the 4-bit code ("full") or only its mantissa bit ("parity", what
    guided rounding needs; 4x smaller). Scales are always kept."""
    stream_to_host: bool = False
    """Keep the record in host memory (pinned on a GPU), streamed from a small device ring at every host check,
    so device memory stays bounded however long the responses (long rollouts; training moves it back per batch)."""

    def __post_init__(self) -> None:
        if self.mode not in ("full", "parity"):
            raise ValueError(f"capture mode must be 'full' or 'parity', got {self.mode!r}")
        if self.sites != "all":
            unknown = sorted(set(self.sites) - set(SITES))
            if unknown:
                raise ValueError(f"unknown capture sites {unknown}; known sites: {SITES}")
        if self.layers != "all" and any(not isinstance(i, int) or i < 0 for i in self.layers):
            raise ValueError(f"capture layers must be non-negative ints, got {sorted(self.layers)}")

    def layer_set(self, n_layers: int) -> frozenset[int]:
        if self.layers == "all":
            return frozenset(range(n_layers))
        bad = sorted(i for i in self.layers if i >= n_layers)
        if bad:
            raise ValueError(f"capture layers {bad} do not exist (the model has {n_layers})")
        return frozenset(self.layers)

    def site_set(self) -> frozenset[str]:
        return frozenset(SITES if self.sites == "all" else self.sites)


@dataclass
class RolloutBatch:
    """One call of ``Engine.generate``: per sequence, its tokens, logprobs, routes and FP4 records."""

    prompts: list[list[int]]
    """The prompts as given."""
    responses: list[list[int]]
    """Sampled tokens, a stop token included as the last one."""
    logprobs: list[list[float]]
    """Logprob of each response token under the temperature-scaled full-vocabulary distribution."""
    finish_reasons: list[FinishReason]
    """``stop`` (a stop token was sampled) or ``length`` (max_new_tokens reached)."""
    policy_version: int
    """Version of the weights that generated the batch."""
    route_table: Tensor
    """[L, B, S, top_k] expert ids by token position, on the engine's device (uint8, int16 beyond 256 experts): row
    b's positions 0 .. record_length(b) - 1 are its routes (see module docstring), later ones hold 0 .. top_k - 1."""
    record: BatchRecord | None = None
    """The FP4 records of the whole call on the engine's device when capture was requested: one uint8 tensor
    [B, S, width] packed by its layout, with the route table and the mask of real positions."""
    capture: CaptureSpec | None = None
    """The capture request this record answers."""
    stats: dict[str, float] = field(default_factory=dict)
    """Engine-side measurements: prefill/decode seconds, decode steps."""

    def __len__(self) -> int:
        return len(self.prompts)

    def record_length(self, i: int) -> int:
        """Rows of sequence i's routes and captures: len(prompt) + len(response) - 1."""
        return len(self.prompts[i]) + len(self.responses[i]) - 1

    @functools.cached_property
    def routes(self) -> list[Tensor]:
        """Per sequence int64 [L, T_b - 1, top_k] on the CPU: expert ids of positions 0 .. T_b - 2."""
        table = self.route_table.cpu()
        return [table[:, b, : self.record_length(b)].long() for b in range(len(self))]

    @functools.cached_property
    def captures(self) -> list[dict[SiteKey, BlockFP4]] | None:
        """Per sequence {(layer, site): BlockFP4 with leading dim T_b - 1} on the CPU, from a full-mode record (None
        without capture); k/v are [T_b - 1, Hkv, Dh] (the cache's bytes), moe_down [T_b - 1, top_k, I]. A
        convenience for tests and tools: training reads ``record`` directly."""
        if self.record is None:
            return None
        data, layout = self.record.data.cpu(), self.record.layout
        return [{key: layout.blocks(data[b, : self.record_length(b)], key) for key in layout.keys}
                for b in range(len(self))]
