"""Policy-gradient losses, split into a per-token loss and a separate aggregation (as in verl core_algos).

Every registered loss takes the same tensors and a PolicyLossConfig:

    logp_new     [B, T]  training-forward logprobs of the sampled tokens (carries the gradient)
    logp_old     [B, T]  logprobs of the policy that generated the batch, as the trainer computes them
                         (None: single update on fresh data, logp_new.detach())
    logp_rollout [B, T]  the rollout engine's logprobs (FP4 sampling), used only by the mismatch correction
    advantages   [B]     one advantage per sequence, broadcast over its tokens
    mask         [B, T]  True on response tokens

and returns (loss scalar, metrics). The correction weight (correction.py) multiplies the per-token policy
loss; the optional KL-to-reference penalty (k3 estimator, off unless kl_coef > 0 and logp_ref is given) is
added per token after it; then agg_loss reduces with the configured mode.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import Tensor

from trace_lightning.rl.correction import CorrectionConfig, correction_weights
from trace_lightning.rl.registry import lookup


@dataclass(frozen=True)
class PolicyLossConfig:
    """Knobs of the policy loss."""

    name: str = "ppo_clip"
    """One of POLICY_LOSSES: "ppo_clip", "gspo", "pg"."""
    clip_low: float = 0.2
    """Ratio lower clip 1 - clip_low (GSPO uses ~3e-4)."""
    clip_high: float = 0.2
    """Ratio upper clip 1 + clip_high (DAPO clip-higher uses 0.28; GSPO ~4e-4)."""
    agg_mode: str = "token_mean"
    """One of AGG_MODES."""
    kl_coef: float = 0.0
    """Weight of the k3 KL-to-reference penalty; 0 disables it."""
    correction: CorrectionConfig = field(default_factory=CorrectionConfig)
    """Rollout-training mismatch correction (none / tis / mis)."""


def masked_mean(x: Tensor, mask: Tensor) -> Tensor:
    """Mean of x over mask (NaN-safe at masked-out positions); 0 when the mask is empty. [B, T] -> []."""
    m = mask.bool()
    return torch.where(m, x, 0.0).sum() / m.sum().clamp(min=1)


def k3(log_ratio: Tensor) -> Tensor:
    """k3 estimator exp(r) - 1 - r of a KL, elementwise (>= 0; Schulman's low-variance estimator)."""
    return torch.expm1(log_ratio) - log_ratio


# ---- aggregation ----------------------------------------------------------------------------------------


def _token_mean(loss: Tensor, mask: Tensor) -> Tensor:
    return masked_mean(loss, mask)


def _seq_sums(loss: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]:
    m = mask.bool()
    return torch.where(m, loss, 0.0).sum(dim=-1), m.sum(dim=-1)  # (B,), (B,)


def _seq_mean_token_mean(loss: Tensor, mask: Tensor) -> Tensor:
    sums, counts = _seq_sums(loss, mask)
    present = counts > 0
    return (sums / counts.clamp(min=1))[present].sum() / present.sum().clamp(min=1)


def _seq_mean_token_sum(loss: Tensor, mask: Tensor) -> Tensor:
    sums, _ = _seq_sums(loss, mask)
    return sums.mean()


def _seq_mean_token_sum_norm(loss: Tensor, mask: Tensor) -> Tensor:
    sums, _ = _seq_sums(loss, mask)
    return sums.mean() / loss.shape[-1]


AGG_MODES: dict[str, Callable[[Tensor, Tensor], Tensor]] = {
    "token_mean": _token_mean,
    "seq_mean_token_mean": _seq_mean_token_mean,
    "seq_mean_token_sum": _seq_mean_token_sum,
    "seq_mean_token_sum_norm": _seq_mean_token_sum_norm,
}


def agg_loss(loss: Tensor, mask: Tensor, mode: str = "token_mean") -> Tensor:
    """Reduce a per-token loss [B, T] over mask [B, T] to a scalar.

    token_mean: sum / #tokens (long answers weigh more) · seq_mean_token_mean: mean over sequences of each
    one's token mean (empty sequences skipped) · seq_mean_token_sum: mean over sequences of token sums ·
    seq_mean_token_sum_norm: token sums / T averaged over sequences (Dr. GRPO's constant normaliser).
    """
    return lookup(AGG_MODES, mode, "aggregation mode")(loss, mask)


# ---- per-token losses -----------------------------------------------------------------------------------

TokenLoss = Callable[[Tensor, Tensor, Tensor, Tensor, PolicyLossConfig], tuple[Tensor, Tensor]]


def ppo_clip_token_loss(
    logp_new: Tensor, logp_old: Tensor, advantages: Tensor, mask: Tensor, cfg: PolicyLossConfig
) -> tuple[Tensor, Tensor]:
    """PPO clipped surrogate per token: max(-A r, -A clip(r, 1 - lo, 1 + hi)), r = exp(new - old).

    Returns (loss [B, T], clipped [B, T] bool: the clipped branch is active, so the token has no gradient).
    """
    ratio = torch.exp(logp_new - logp_old)  # (B, T)
    adv = advantages.unsqueeze(-1)  # (B, 1)
    unclipped = -adv * ratio
    clipped = -adv * ratio.clamp(1.0 - cfg.clip_low, 1.0 + cfg.clip_high)
    return torch.maximum(unclipped, clipped), clipped > unclipped


def gspo_token_loss(
    logp_new: Tensor, logp_old: Tensor, advantages: Tensor, mask: Tensor, cfg: PolicyLossConfig
) -> tuple[Tensor, Tensor]:
    """GSPO: PPO clipping on the sequence ratio s = exp(mean_t (new - old)), broadcast to tokens.

    Clipping whole sequences is more stable for MoE, where one token's ratio is noisy under expert
    changes. Pair it with agg_mode "seq_mean_token_mean" and clip ~(3e-4, 4e-4). Shapes as ppo_clip.
    """
    m = mask.bool()
    seq_log_ratio = torch.where(m, logp_new - logp_old, 0.0).sum(-1) / m.sum(-1).clamp(min=1)  # (B,)
    tok_log_ratio = seq_log_ratio.unsqueeze(-1).expand_as(logp_new)
    return ppo_clip_token_loss(tok_log_ratio, torch.zeros_like(tok_log_ratio), advantages, mask, cfg)


def pg_token_loss(
    logp_new: Tensor, logp_old: Tensor, advantages: Tensor, mask: Tensor, cfg: PolicyLossConfig
) -> tuple[Tensor, Tensor]:
    """Unclipped policy gradient -A r (REINFORCE when logp_old = logp_new.detach()). Never clipped."""
    ratio = torch.exp(logp_new - logp_old)
    return -advantages.unsqueeze(-1) * ratio, torch.zeros_like(ratio, dtype=torch.bool)


# ---- full losses ----------------------------------------------------------------------------------------


def _policy_loss(
    token_loss: TokenLoss,
    logp_new: Tensor,
    logp_old: Tensor | None,
    logp_rollout: Tensor | None,
    advantages: Tensor,
    mask: Tensor,
    cfg: PolicyLossConfig | None,
    logp_ref: Tensor | None,
) -> tuple[Tensor, dict[str, Tensor]]:
    cfg = cfg or PolicyLossConfig()
    m = mask.bool()
    logp_old = logp_new.detach() if logp_old is None else logp_old.detach()
    tok, clipped = token_loss(logp_new, logp_old, advantages.detach().float(), m, cfg)
    weights = correction_weights(logp_old, logp_rollout, m, cfg.correction)  # (B, T), detached
    tok = tok * weights
    metrics: dict[str, Tensor] = {
        "policy/clip_frac": masked_mean(clipped.float(), m),
        "policy/approx_kl": masked_mean(k3(logp_new.detach() - logp_old), m),
        "policy/correction_weight_mean": masked_mean(weights, m),
        "policy/correction_keep_frac": masked_mean((weights > 0).float(), m),
        "policy/correction_masked_frac": masked_mean((weights == 0).float(), m),
    }
    if cfg.kl_coef > 0 and logp_ref is not None:
        kl = k3(logp_ref.detach() - logp_new)  # KL(pi || ref), samples from pi
        tok = tok + cfg.kl_coef * kl
        metrics["policy/kl_ref"] = masked_mean(kl.detach(), m)
    loss = agg_loss(tok, m, cfg.agg_mode)
    metrics["policy/loss"] = loss.detach()
    return loss, metrics


def ppo_clip_loss(
    logp_new: Tensor,
    logp_old: Tensor | None,
    logp_rollout: Tensor | None,
    advantages: Tensor,
    mask: Tensor,
    cfg: PolicyLossConfig | None = None,
    logp_ref: Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """PPO / GRPO clipped loss (shapes in the module docstring). Returns (loss [], metrics)."""
    return _policy_loss(ppo_clip_token_loss, logp_new, logp_old, logp_rollout, advantages, mask, cfg, logp_ref)


def gspo_loss(
    logp_new: Tensor,
    logp_old: Tensor | None,
    logp_rollout: Tensor | None,
    advantages: Tensor,
    mask: Tensor,
    cfg: PolicyLossConfig | None = None,
    logp_ref: Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """GSPO sequence-ratio clipped loss. Returns (loss [], metrics)."""
    return _policy_loss(gspo_token_loss, logp_new, logp_old, logp_rollout, advantages, mask, cfg, logp_ref)


def pg_loss(
    logp_new: Tensor,
    logp_old: Tensor | None,
    logp_rollout: Tensor | None,
    advantages: Tensor,
    mask: Tensor,
    cfg: PolicyLossConfig | None = None,
    logp_ref: Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Unclipped policy-gradient loss. Returns (loss [], metrics)."""
    return _policy_loss(pg_token_loss, logp_new, logp_old, logp_rollout, advantages, mask, cfg, logp_ref)


PolicyLoss = Callable[..., tuple[Tensor, dict[str, Tensor]]]
POLICY_LOSSES: dict[str, PolicyLoss] = {"ppo_clip": ppo_clip_loss, "gspo": gspo_loss, "pg": pg_loss}


def policy_loss(
    logp_new: Tensor,
    logp_old: Tensor | None,
    logp_rollout: Tensor | None,
    advantages: Tensor,
    mask: Tensor,
    cfg: PolicyLossConfig | None = None,
    logp_ref: Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """The loss named by cfg.name. Returns (loss [], metrics)."""
    cfg = cfg or PolicyLossConfig()
    fn = lookup(POLICY_LOSSES, cfg.name, "policy loss")
    return fn(logp_new, logp_old, logp_rollout, advantages, mask, cfg, logp_ref)
