"""Rollout-training mismatch correction: importance weights between the rollout and the trainer.

FP4 rollouts sample from pi_rollout, but the gradient is taken for pi_train; even with TRACE the two differ
slightly. With d = logp_train - logp_rollout per response token, the correction returns a per-token weight
w [B, T] that multiplies the per-token policy loss *before* aggregation:

    loss_tok <- w * loss_tok        (w detached; the aggregation denominators are unchanged)

so a masked-out token contributes zero but still counts in `token_mean`, as in verl. Weights are 0 at
padding. Levels: "token" uses exp(d_t); "sequence" uses exp(sum_t d_t) for every token of the sequence;
"geometric" uses exp(mean_t d_t), the per-token geometric mean, which stays near 1 for long sequences.

- "none": w = 1.
- "tis": truncated importance sampling, w = min(ratio, cap) (Yao et al., "Your efficient RL framework
  secretly brings you off-policy RL training").
- "mis": masked importance sampling, w = ratio if low <= ratio <= high else 0 (tokens or whole sequences
  outside the trust band are dropped instead of clipped).
- "icepop": IcePop's token mask (Ring-1T, "Small Leak Can Sink a Great Ship"), w = 1 if 1/bound <= ratio <= bound
  else 0: a token whose engines disagree by more than a factor `bound` carries no gradient, the others carry their
  plain (unweighted) gradient. verl's mask mode defaults to the same band ([1/2, 2]: threshold 2, lower bound its
  reciprocal). Always per token: a sequence-level ratio would drop whole responses, which is what "mis" is for.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from trace_lightning.rl.registry import lookup

LEVELS = ("token", "sequence", "geometric")


@dataclass(frozen=True)
class CorrectionConfig:
    """Which rollout-mismatch correction to apply and its thresholds."""

    name: str = "none"
    """One of CORRECTIONS: "none", "tis", "mis", "icepop"."""
    level: str = "token"
    """Ratio granularity: "token", "sequence" (exp of the summed log ratio) or "geometric" (exp of its mean)."""
    cap: float = 2.0
    """TIS truncation: w = min(ratio, cap)."""
    low: float = 0.5
    """MIS: ratios below this are masked out."""
    high: float = 2.0
    """MIS: ratios above this are masked out."""
    bound: float = 2.0
    """IcePop: tokens whose ratio leaves [1/bound, bound] get weight 0 (bound > 1)."""


def log_ratio(logp_train: Tensor, logp_rollout: Tensor, mask: Tensor) -> Tensor:
    """d = logp_train - logp_rollout, detached, 0 where mask is False. All [B, T]."""
    d = (logp_train.detach().float() - logp_rollout.detach().float()).nan_to_num(0.0)
    return torch.where(mask.bool(), d, 0.0)


def level_log_ratio(logp_train: Tensor, logp_rollout: Tensor, mask: Tensor, level: str = "token") -> Tensor:
    """Log importance ratio at the given level, broadcast to tokens: [B, T] (0 at padding)."""
    m = mask.bool()
    d = log_ratio(logp_train, logp_rollout, m)  # (B, T)
    if level == "token":
        return d
    if level not in LEVELS:
        raise ValueError(f"unknown correction level {level!r}; known: {list(LEVELS)}")
    seq = d.sum(dim=-1, keepdim=True)  # (B, 1)
    if level == "geometric":
        seq = seq / m.sum(dim=-1, keepdim=True).clamp(min=1)
    return torch.where(m, seq.expand_as(d), 0.0)


def tis_weights(
    logp_train: Tensor, logp_rollout: Tensor, mask: Tensor, cap: float = 2.0, level: str = "token"
) -> Tensor:
    """Truncated IS weight min(exp(d), cap), detached. All [B, T]; 0 at padding."""
    ratio = level_log_ratio(logp_train, logp_rollout, mask, level).exp()
    return torch.where(mask.bool(), ratio.clamp(max=cap), 0.0)


def mis_mask(
    logp_train: Tensor, logp_rollout: Tensor, mask: Tensor, low: float = 0.5, high: float = 2.0, level: str = "token"
) -> Tensor:
    """Bool [B, T]: response tokens whose (token, sequence or geometric) ratio lies in [low, high]."""
    ratio = level_log_ratio(logp_train, logp_rollout, mask, level).exp()
    return mask.bool() & (ratio >= low) & (ratio <= high)


def mis_weights(
    logp_train: Tensor, logp_rollout: Tensor, mask: Tensor, low: float = 0.5, high: float = 2.0, level: str = "token"
) -> Tensor:
    """Masked IS weight: ratio where mis_mask holds, else 0. Detached, [B, T]."""
    ratio = level_log_ratio(logp_train, logp_rollout, mask, level).exp()
    return torch.where(mis_mask(logp_train, logp_rollout, mask, low, high, level), ratio, 0.0)


def icepop_mask(logp_train: Tensor, logp_rollout: Tensor, mask: Tensor, bound: float = 2.0) -> Tensor:
    """Bool [B, T]: response tokens whose per-token ratio lies in [1/bound, bound] (compared in log space, so a
    ratio of exactly bound or 1/bound is kept)."""
    if not bound > 1.0:
        raise ValueError(f"icepop bound must be > 1 (the band is [1/bound, bound]), got {bound}")
    d = log_ratio(logp_train, logp_rollout, mask)
    return mask.bool() & (d.abs() <= math.log(bound))


def _none(logp_train: Tensor, logp_rollout: Tensor, mask: Tensor, cfg: CorrectionConfig) -> Tensor:
    return mask.float()


def _tis(logp_train: Tensor, logp_rollout: Tensor, mask: Tensor, cfg: CorrectionConfig) -> Tensor:
    return tis_weights(logp_train, logp_rollout, mask, cfg.cap, cfg.level)


def _mis(logp_train: Tensor, logp_rollout: Tensor, mask: Tensor, cfg: CorrectionConfig) -> Tensor:
    return mis_weights(logp_train, logp_rollout, mask, cfg.low, cfg.high, cfg.level)


def _icepop(logp_train: Tensor, logp_rollout: Tensor, mask: Tensor, cfg: CorrectionConfig) -> Tensor:
    return icepop_mask(logp_train, logp_rollout, mask, cfg.bound).float()


CorrectionFn = Callable[[Tensor, Tensor, Tensor, CorrectionConfig], Tensor]
CORRECTIONS: dict[str, CorrectionFn] = {"none": _none, "tis": _tis, "mis": _mis, "icepop": _icepop}


def correction_weights(
    logp_train: Tensor, logp_rollout: Tensor | None, mask: Tensor, cfg: CorrectionConfig | None = None
) -> Tensor:
    """Per-token weights [B, T] for cfg.name; "none" needs no rollout logprobs."""
    cfg = cfg or CorrectionConfig()
    fn = lookup(CORRECTIONS, cfg.name, "correction")
    if logp_rollout is None:
        if cfg.name != "none":
            raise ValueError(f"correction {cfg.name!r} needs rollout logprobs")
        logp_rollout = logp_train
    return fn(logp_train, logp_rollout, mask, cfg)
