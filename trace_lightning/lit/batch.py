"""Typed batches that travel from the rollout worker to the training step."""

from __future__ import annotations

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


def pad_sequences(seqs: list[list[int]], pad_id: int) -> tuple[Tensor, Tensor]:
    """Right-pad token lists -> (tokens (B, T) int64, attention_mask (B, T) bool)."""
    width = max(len(s) for s in seqs)
    tokens = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.bool)
    for i, s in enumerate(seqs):
        tokens[i, : len(s)] = torch.tensor(s, dtype=torch.long)
        mask[i, : len(s)] = True
    return tokens, mask


def response_targets(prompt_lens: list[int], total_lens: list[int], width: int) -> Tensor:
    """(B, width-1) mask of the shifted positions whose target is a response token."""
    mask = torch.zeros((len(prompt_lens), width - 1), dtype=torch.bool)
    for i, (p, t) in enumerate(zip(prompt_lens, total_lens, strict=True)):
        mask[i, p - 1 : t - 1] = True
    return mask
