"""Sampling without host syncs and with one random stream per sequence.

Tokens are drawn by the Gumbel-max trick, argmax(logits / T + g), with the Gumbel noise g taken from a
counter-based hash of (sequence seed, step, token id) computed with integer tensor ops. So a sequence's
draws depend only on its own seed and step, never on the batch it shares or on the device, no
torch.Generator state has to be kept per row, and nothing leaves the device between steps.
The reported logprob is always that of the full, untruncated temperature-scaled distribution.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

_M32 = 0xFFFFFFFF
_M64 = (1 << 64) - 1


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _M64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _M64
    return x ^ (x >> 31)


def sequence_seeds(seed: int, n: int) -> list[int]:
    """The per-sequence seeds one batch seed expands to (pass them as a list to reproduce a sequence alone)."""
    return [_splitmix64(_splitmix64(seed & _M64) ^ i) for i in range(n)]


def seed_keys(seeds: Sequence[int], device: torch.device | str) -> Tensor:
    """Per-sequence 64-bit seeds -> int64 [B, 2] of their two 32-bit words."""
    words = [[s & _M32, (s >> 32) & _M32] for s in (_splitmix64(s & _M64) for s in seeds)]
    return torch.tensor(words, dtype=torch.int64, device=device)


def _mul32(h: Tensor, c: int) -> Tensor:
    """(h * c) mod 2^32 for h in [0, 2^32), split so no int64 product overflows."""
    lo, hi = c & 0xFFFF, c >> 16
    return (h * lo + (((h * hi) & 0xFFFF) << 16)) & _M32


def _fmix32(h: Tensor) -> Tensor:
    """murmur3's 32-bit finalizer: a bijection on [0, 2^32) with full avalanche."""
    h = h ^ (h >> 16)
    h = _mul32(h, 0x85EBCA6B)
    h = h ^ (h >> 13)
    h = _mul32(h, 0xC2B2AE35)
    return h ^ (h >> 16)


def uniform_noise(keys: Tensor, step: int | Tensor, vocab: int) -> Tensor:
    """float32 [B, V] in (0, 1), a pure function of (keys[b], step, token id); step may be a (1,) device
    tensor (a CUDA-graph replay reads it from the device)."""
    counter = torch.zeros_like(keys[:, :1]) + (step + 1)  # (B, 1)
    stream = _fmix32(keys[:, :1] ^ _fmix32(keys[:, 1:] ^ _mul32(counter, 0x9E3779B9)))
    ids = torch.arange(vocab, dtype=torch.int64, device=keys.device)[None]  # (1, V)
    h = _fmix32(stream ^ _mul32(ids, 0x9E3779B9))  # (B, V), distinct per token id
    h = _fmix32(h ^ keys[:, 1:])
    return ((h >> 8).float() + 0.5) * 2.0**-24


def truncate(scaled: Tensor, top_k: int, top_p: float) -> Tensor:
    """Scaled logits [B, V] with tokens outside top-k / top-p set to -inf (the most likely token always stays)."""
    if 0 < top_k < scaled.shape[-1]:
        kth = scaled.topk(top_k, dim=-1).values[:, -1:]  # (B, 1)
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = scaled.sort(dim=-1, descending=True)
        probs = sorted_logits.softmax(dim=-1)
        mass_before = probs.cumsum(dim=-1) - probs  # (B, V) mass of strictly more likely tokens
        drop = (mass_before >= top_p).scatter(-1, order, mass_before >= top_p)
        scaled = scaled.masked_fill(drop, float("-inf"))
    return scaled


def suppress_early(scores: Tensor, step: int | Tensor, banned: Tensor | None, until: int) -> Tensor:
    """Scores [B, V] with the `banned` ids at -inf while a row's step (int, (1,) or (B, 1)) is below `until`: no stop
    token before the min_new_tokens-th response token (vLLM's min_tokens). Sampling only, as top-k and top-p: the
    reported logprob stays the full distribution's."""
    if banned is None or until <= 0 or banned.numel() == 0:
        return scores
    early = torch.as_tensor(step, device=scores.device).reshape(-1, 1) < until  # (1 or B, 1)
    # index_fill_ takes the value as a scalar argument; `cols[banned] = True` would copy a host tensor, which a
    # CUDA-graph capture refuses
    banned_cols = torch.zeros(scores.shape[-1], dtype=torch.bool, device=scores.device).index_fill_(0, banned, True)
    return scores.masked_fill(early & banned_cols, float("-inf"))


def sample(logits: Tensor, keys: Tensor, step: int | Tensor, temperature: float, top_k: int = 0,
           top_p: float = 1.0, banned: Tensor | None = None, banned_until: int = 0) -> tuple[Tensor, Tensor]:
    """logits [B, V] -> (tokens int64 [B], logprobs float32 [B] of those tokens, full-vocabulary).

    temperature 0 is greedy and reports the unscaled logprob; otherwise the logprob is at that temperature.
    banned / banned_until: ids not sampled before step banned_until (suppress_early).
    """
    logits = logits.float()
    if temperature == 0:
        tokens = suppress_early(logits, step, banned, banned_until).argmax(dim=-1)
        return tokens, logits.log_softmax(dim=-1).gather(-1, tokens[:, None]).squeeze(-1)
    scaled = logits / temperature
    gumbel = -torch.log(-torch.log(uniform_noise(keys, step, logits.shape[-1])))
    allowed = suppress_early(truncate(scaled, top_k, top_p), step, banned, banned_until)
    tokens = (allowed + gumbel).argmax(dim=-1)
    return tokens, scaled.log_softmax(dim=-1).gather(-1, tokens[:, None]).squeeze(-1)
