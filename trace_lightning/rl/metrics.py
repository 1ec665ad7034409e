"""Train-rollout mismatch metrics (DESIGN.md section 7) and agreement fractions, pure and accumulated.

d = lp_train - lp_rollout over response tokens (both at the sampling temperature, full vocabulary), and
w = exp(d) is the per-token importance ratio. Every metric is a function of a few additive sufficient
statistics (count, sums, min, max), so the torchmetrics classes accumulate those across steps and ranks and
compute() equals the pure function on all tokens seen, not an average of per-step values.
"""

from __future__ import annotations

import torch
from torch import Tensor
from torchmetrics import Metric

_SUMS = ("n", "k3", "abs_d", "abs_dp", "mult", "w", "w2")
MISMATCH_KEYS = (
    "mismatch/k3_kl",
    "mismatch/logprob_abs_diff",
    "mismatch/prob_abs_diff",
    "mismatch/token_mult_prob_error",
    "mismatch/is_ratio_min",
    "mismatch/is_ratio_mean",
    "mismatch/is_ratio_max",
    "mismatch/ess",
)


def _mismatch_stats(lp_train: Tensor, lp_rollout: Tensor, mask: Tensor) -> dict[str, Tensor]:
    """Sufficient statistics in float64 over masked tokens. Inputs [B, T]."""
    m = mask.bool()
    lt = lp_train.detach().double()[m]  # (N,)
    lr = lp_rollout.detach().double()[m]
    d = lt - lr
    w = d.exp()
    inf = torch.tensor(float("inf"), dtype=torch.float64, device=d.device)
    return {
        "n": torch.tensor(float(d.numel()), dtype=torch.float64, device=d.device),
        "k3": (torch.expm1(d) - d).sum(),
        "abs_d": d.abs().sum(),
        "abs_dp": (lt.exp() - lr.exp()).abs().sum(),
        "mult": d.abs().exp().sum(),
        "w": w.sum(),
        "w2": (w * w).sum(),
        "w_min": w.min() if w.numel() else inf,
        "w_max": w.max() if w.numel() else -inf,
    }


def _stats_to_metrics(s: dict[str, Tensor]) -> dict[str, Tensor]:
    n = s["n"]
    nan = torch.full_like(n, float("nan"))
    empty = n == 0

    def mean(total: Tensor) -> Tensor:
        return torch.where(empty, nan, total / n.clamp(min=1))

    out = {
        "mismatch/k3_kl": mean(s["k3"]),
        "mismatch/logprob_abs_diff": mean(s["abs_d"]),
        "mismatch/prob_abs_diff": mean(s["abs_dp"]),
        "mismatch/token_mult_prob_error": mean(s["mult"]),
        "mismatch/is_ratio_min": torch.where(empty, nan, s["w_min"]),
        "mismatch/is_ratio_mean": mean(s["w"]),
        "mismatch/is_ratio_max": torch.where(empty, nan, s["w_max"]),
        "mismatch/ess": torch.where(empty, nan, s["w"] ** 2 / (n * s["w2"]).clamp(min=1e-300)),
    }
    return {k: v.float() for k, v in out.items()}


def mismatch_metrics(lp_train: Tensor, lp_rollout: Tensor, mask: Tensor) -> dict[str, Tensor]:
    """The section-7 mismatch metrics over response tokens. Inputs [B, T]; values are 0-dim float32.

    k3_kl = mean(exp(d) - 1 - d) · logprob_abs_diff = mean|d| · prob_abs_diff = mean|p_t - p_r| ·
    token_mult_prob_error = mean exp(|d|) · is_ratio_{min,mean,max} of w = exp(d) ·
    ess = (sum w)^2 / (N sum w^2) in (0, 1]. NaN when the mask is empty.
    """
    return _stats_to_metrics(_mismatch_stats(lp_train, lp_rollout, mask))


def _agreement_counts(equal: Tensor, mask: Tensor | None) -> tuple[Tensor, Tensor]:
    if mask is None:
        return equal.sum().double(), torch.tensor(float(equal.numel()), dtype=torch.float64, device=equal.device)
    m = mask.bool().expand_as(equal)
    return (equal & m).sum().double(), m.sum().double()


def _fraction(equal: Tensor, total: Tensor) -> Tensor:
    """equal / total as float32, NaN when nothing was compared."""
    return torch.where(total > 0, equal / total.clamp(min=1), float("nan")).float()


def _value_equal(a: Tensor, b: Tensor) -> Tensor:
    # IEEE equality already treats +0.0 == -0.0 and NaN != NaN, which is exactly the rule we want.
    return a == b


def _code_equal(codes_a: Tensor, codes_b: Tensor) -> Tensor:
    if codes_a.dtype != torch.uint8 or codes_b.dtype != torch.uint8:
        raise ValueError(f"codes must be uint8, got {codes_a.dtype} and {codes_b.dtype}")
    # Codes 0 and 8 are +0 and -0: the same value, so the sign bit of a zero is ignored.
    return torch.where(codes_a == 8, 0, codes_a) == torch.where(codes_b == 8, 0, codes_b)


def agreement(a: Tensor, b: Tensor, mask: Tensor | None = None) -> Tensor:
    """Fraction of elements (under mask) where a == b; +0.0 equals -0.0, NaN equals nothing. -> [] float32."""
    return _fraction(*_agreement_counts(_value_equal(a, b), mask))


def code_agreement(codes_a: Tensor, codes_b: Tensor, mask: Tensor | None = None) -> Tensor:
    """Fraction of equal unpacked E2M1 codes (uint8, one per element; 0 and 8 count as equal). -> []."""
    return _fraction(*_agreement_counts(_code_equal(codes_a, codes_b), mask))


class MismatchMetric(Metric):
    """Accumulates mismatch_metrics over steps (and ranks); compute() returns the same dict of keys."""

    full_state_update = False
    higher_is_better = None

    def __init__(self, **kwargs: object) -> None:
        super().__init__(**kwargs)
        for name in _SUMS:
            self.add_state(name, default=torch.tensor(0.0, dtype=torch.float64), dist_reduce_fx="sum")
        self.add_state("w_min", default=torch.tensor(float("inf"), dtype=torch.float64), dist_reduce_fx="min")
        self.add_state("w_max", default=torch.tensor(float("-inf"), dtype=torch.float64), dist_reduce_fx="max")

    def update(self, lp_train: Tensor, lp_rollout: Tensor, mask: Tensor) -> None:
        stats = _mismatch_stats(lp_train, lp_rollout, mask)
        for name in _SUMS:
            setattr(self, name, getattr(self, name) + stats[name])
        self.w_min = torch.minimum(self.w_min, stats["w_min"])
        self.w_max = torch.maximum(self.w_max, stats["w_max"])

    def compute(self) -> dict[str, Tensor]:
        return _stats_to_metrics({name: getattr(self, name) for name in (*_SUMS, "w_min", "w_max")})


class AgreementMetric(Metric):
    """Accumulated fraction of equal elements: values (codes=False) or E2M1 codes (codes=True)."""

    full_state_update = False
    higher_is_better = True

    def __init__(self, codes: bool = False, **kwargs: object) -> None:
        super().__init__(**kwargs)
        self.codes = codes
        self.add_state("equal", default=torch.tensor(0.0, dtype=torch.float64), dist_reduce_fx="sum")
        self.add_state("total", default=torch.tensor(0.0, dtype=torch.float64), dist_reduce_fx="sum")

    def update(self, a: Tensor, b: Tensor, mask: Tensor | None = None) -> None:
        equal = _code_equal(a, b) if self.codes else _value_equal(a, b)
        eq, total = _agreement_counts(equal, mask)
        self.equal = self.equal + eq
        self.total = self.total + total

    def compute(self) -> Tensor:
        return _fraction(self.equal, self.total)
