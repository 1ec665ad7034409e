"""Typed batches that travel from the rollout worker to the training step."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor


@dataclass
class DemoBatch:
    """Supervised warm-start batch: demonstrations, loss on the response tokens only."""

    tokens: Tensor
    """(B, T) prompt + demonstration, right-padded."""
    attention_mask: Tensor
    """(B, T) True on real tokens."""
    target_mask: Tensor
    """(B, T-1) True where tokens[:, 1:] is a response token."""


@dataclass
class TrainBatch:
    """One RL step's rollouts, aligned for the training forward over tokens[:, :-1]."""

    tokens: Tensor
    """(B, T) prompt + response, right-padded."""
    attention_mask: Tensor
    """(B, T) True on real tokens."""
    response_mask: Tensor
    """(B, T-1) True where tokens[:, 1:] is a sampled response token."""
    rollout_logprobs: Tensor
    """(B, T-1) rollout logprob of tokens[:, 1:] (0 outside the response)."""
    rewards: Tensor
    """(B,) verifier rewards."""
    group_size: int
    """Consecutive rows that share a prompt."""
    policy_version: int
    """Version of the weights that generated the rollouts."""
    routes: list[Tensor] | None = None
    """Per layer (B, T-1, top_k) rollout expert ids (for routing replay and route agreement)."""
    record: Any | None = None
    """The BatchRecord guidance reads (guided methods): the rollout's packed record, on its device, cut to the
    training window and compacted; checked (or sent through the bytes transport) by the CacheExchange callback."""
    audit_record: Any | None = None
    """The full all-layer BatchRecord kept on audit steps for code / value agreement."""
    samples: list[dict[str, Any]] = field(default_factory=list)
    """A few decoded (prompt, response, reward) examples for logging."""
    rollout_stats: dict[str, float] = field(default_factory=dict)
    """Rollout-side measurements (tokens/s, capture ms)."""

    @property
    def num_response_tokens(self) -> int:
        return int(self.response_mask.sum())

    def rows(self, rows: slice) -> TrainBatch:
        """Sequences `rows` of this batch (views, the same padded width): a micro-batch of the training step. Its
        group_size stays the batch's: advantages are computed on the whole batch, before it is split."""
        def cut(record: Any) -> Any:
            return None if record is None else record.rows(rows)

        return TrainBatch(self.tokens[rows], self.attention_mask[rows], self.response_mask[rows],
                          self.rollout_logprobs[rows], self.rewards[rows], self.group_size, self.policy_version,
                          None if self.routes is None else [r[rows] for r in self.routes], cut(self.record),
                          cut(self.audit_record), self.samples, self.rollout_stats)


def micro_batches(rows: int, size: int | None) -> list[slice]:
    """Row slices of at most `size` rows covering 0..rows-1 (one slice for None)."""
    step = rows if size is None else max(1, size)
    return [slice(a, min(rows, a + step)) for a in range(0, rows, step)]


def spans(starts: list[int], stops: list[int], width: int) -> Tensor:
    """(B, width) mask of columns starts[b] <= c < stops[b]: where a row's ragged values go, in one op."""
    cols = torch.arange(width)
    return (cols >= torch.tensor(starts)[:, None]) & (cols < torch.tensor(stops)[:, None])


def place(rows: list[list[Any]], starts: list[int], width: int, fill: float | int, dtype: torch.dtype) -> Tensor:
    """(B, width) of `fill` with row b's values at columns starts[b] onwards: one tensor from one flat list (a
    tensor per row cost ~20 us each, 10 ms for an RL step's 512 rollouts)."""
    out = torch.full((len(rows), width), fill, dtype=dtype)
    out[spans(starts, [s + len(r) for s, r in zip(starts, rows, strict=True)], width)] = torch.tensor(
        list(itertools.chain.from_iterable(rows)), dtype=dtype)
    return out


def pad_sequences(seqs: list[list[int]], pad_id: int) -> tuple[Tensor, Tensor]:
    """Right-pad token lists -> (tokens (B, T) int64, attention_mask (B, T) bool)."""
    width, starts = max(len(s) for s in seqs), [0] * len(seqs)
    return place(seqs, starts, width, pad_id, torch.long), spans(starts, [len(s) for s in seqs], width)


def response_targets(prompt_lens: list[int], total_lens: list[int], width: int) -> Tensor:
    """(B, width-1) mask of the shifted positions whose target is a response token."""
    return spans([p - 1 for p in prompt_lens], [t - 1 for t in total_lens], width - 1)
