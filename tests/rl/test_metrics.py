"""Mismatch metrics, agreement and logprobs against hand-computed values."""

import math

import pytest
import torch

from trace_lightning.rl import (
    MISMATCH_KEYS,
    AgreementMetric,
    MismatchMetric,
    agreement,
    code_agreement,
    mismatch_metrics,
    token_logprobs,
)

LN2 = math.log(2.0)


def _known() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """d = [0, ln 2] on two response tokens; the third (padding) holds junk."""
    lp_r = torch.tensor([[math.log(0.5), math.log(0.25), float("nan")]])
    lp_t = torch.tensor([[math.log(0.5), math.log(0.5), 40.0]])
    return lp_t, lp_r, torch.tensor([[1, 1, 0]], dtype=torch.bool)


def test_mismatch_metrics_on_known_d() -> None:
    m = mismatch_metrics(*_known())
    assert tuple(m) == MISMATCH_KEYS
    expected = {
        "mismatch/k3_kl": (0 + (2 - 1 - LN2)) / 2,
        "mismatch/logprob_abs_diff": LN2 / 2,
        "mismatch/prob_abs_diff": (0 + 0.25) / 2,
        "mismatch/token_mult_prob_error": (1 + 2) / 2,
        "mismatch/is_ratio_min": 1.0,
        "mismatch/is_ratio_mean": 1.5,
        "mismatch/is_ratio_max": 2.0,
        "mismatch/ess": 3**2 / (2 * (1 + 4)),
    }
    for key, value in expected.items():
        assert m[key].item() == pytest.approx(value, rel=1e-6), key


def test_identical_logprobs_are_perfect() -> None:
    lp = torch.log(torch.rand(3, 5, generator=torch.Generator().manual_seed(0)))
    m = mismatch_metrics(lp, lp.clone(), torch.ones(3, 5, dtype=torch.bool))
    assert m["mismatch/k3_kl"].item() == 0.0 and m["mismatch/ess"].item() == 1.0
    assert m["mismatch/token_mult_prob_error"].item() == 1.0


def test_empty_mask_gives_nan() -> None:
    m = mismatch_metrics(torch.zeros(1, 2), torch.zeros(1, 2), torch.zeros(1, 2, dtype=torch.bool))
    assert all(math.isnan(v.item()) for v in m.values())


def test_mismatch_metric_accumulates_tokens_not_step_means() -> None:
    g = torch.Generator().manual_seed(1)
    lp_t, lp_r = -torch.rand(4, 6, generator=g) * 3, -torch.rand(4, 6, generator=g) * 3
    mask = torch.rand(4, 6, generator=g) > 0.3
    metric = MismatchMetric()
    metric.update(lp_t[:1], lp_r[:1], mask[:1])
    metric.update(lp_t[1:], lp_r[1:], mask[1:])
    got, want = metric.compute(), mismatch_metrics(lp_t, lp_r, mask)
    for key in MISMATCH_KEYS:
        torch.testing.assert_close(got[key], want[key], rtol=1e-6, atol=0)
    metric.reset()
    with pytest.warns(UserWarning, match="before the ``update``"):
        assert math.isnan(metric.compute()["mismatch/k3_kl"].item())


def test_value_agreement_signed_zero_and_nan() -> None:
    a = torch.tensor([0.0, -0.0, float("nan"), 1.0])
    b = torch.tensor([-0.0, 0.0, float("nan"), 2.0])
    assert agreement(a, b).item() == 0.5
    assert agreement(a, b, torch.tensor([True, True, True, False])).item() == pytest.approx(2 / 3)
    assert agreement(a, a).item() == 0.75  # NaN never equals itself


def test_code_agreement_two_zeros() -> None:
    a = torch.tensor([0, 8, 1, 9, 7], dtype=torch.uint8)
    b = torch.tensor([8, 0, 1, 1, 7], dtype=torch.uint8)
    assert code_agreement(a, b).item() == pytest.approx(0.8)
    with pytest.raises(ValueError, match="uint8"):
        code_agreement(a.float(), b)


def test_agreement_metric_accumulates() -> None:
    metric = AgreementMetric(codes=True)
    metric.update(torch.tensor([0, 1], dtype=torch.uint8), torch.tensor([8, 2], dtype=torch.uint8))
    metric.update(torch.tensor([3, 3], dtype=torch.uint8), torch.tensor([3, 3], dtype=torch.uint8))
    assert metric.compute().item() == 0.75
    values = AgreementMetric()
    values.update(torch.tensor([[0.0, 1.0]]), torch.tensor([[-0.0, 3.0]]), mask=torch.tensor([[True, True]]))
    assert values.compute().item() == 0.5


def test_token_logprobs_temperature() -> None:
    logits = torch.tensor([[[0.0, math.log(3.0)]]])
    tokens = torch.tensor([[1]])
    assert token_logprobs(logits, tokens, 1.0).item() == pytest.approx(math.log(0.75))
    assert token_logprobs(logits, tokens, 0.0).item() == pytest.approx(math.log(0.75))  # greedy: unscaled
    s3 = math.sqrt(3.0)  # logits / 2 -> softmax weight sqrt 3 for token 1
    assert token_logprobs(logits, tokens, 2.0).item() == pytest.approx(math.log(s3 / (1 + s3)))
    assert token_logprobs(logits.bfloat16(), tokens, 1.0).dtype == torch.float32
