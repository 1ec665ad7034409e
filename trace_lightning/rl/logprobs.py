"""Logprobs of sampled tokens, computed the way the sampler saw them.

Mismatch metrics and importance ratios compare the rollout's and the trainer's logprob of the same token,
so both must use the sampling temperature and the full vocabulary (no top-k / top-p renormalisation).
"""

from __future__ import annotations

import torch
from torch import Tensor


def token_logprobs(logits: Tensor, tokens: Tensor, temperature: float = 1.0) -> Tensor:
    """log softmax(logits / temperature)[tokens] in float32. logits [B, T, V], tokens [B, T] -> [B, T].

    temperature 0 (greedy sampling) means the logits are used unscaled.
    """
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    scaled = logits.float()
    if temperature > 0 and temperature != 1.0:
        scaled = scaled / temperature
    picked = scaled.gather(-1, tokens.long().unsqueeze(-1)).squeeze(-1)  # (B, T)
    return picked - torch.logsumexp(scaled, dim=-1)
