"""Policy losses, aggregation and corrections against hand-computed values."""

import math

import pytest
import torch

from trace_lightning.rl import (
    POLICY_LOSSES,
    CorrectionConfig,
    PolicyLossConfig,
    agg_loss,
    correction_weights,
    icepop_mask,
    mis_mask,
    policy_loss,
    ppo_clip_loss,
    ppo_clip_token_loss,
    tis_weights,
)

LN2 = math.log(2.0)
RATIOS = torch.tensor([[0.5, 1.0, 1.5], [0.5, 1.0, 1.5]])
FULL = torch.ones(2, 3, dtype=torch.bool)


def test_ppo_clip_per_token_at_known_ratios() -> None:
    loss, clipped = ppo_clip_token_loss(
        RATIOS.log(), torch.zeros(2, 3), torch.tensor([1.0, -1.0]), FULL, PolicyLossConfig()
    )
    # A = +1: max(-r, -clip(r, .8, 1.2)); A = -1: max(r, clip(r, .8, 1.2)).
    torch.testing.assert_close(loss, torch.tensor([[-0.5, -1.0, -1.2], [0.8, 1.0, 1.5]]))
    assert clipped.tolist() == [[False, False, True], [True, False, False]]


def test_ppo_clip_loss_scalar_and_metrics() -> None:
    loss, metrics = ppo_clip_loss(RATIOS.log(), torch.zeros(2, 3), None, torch.tensor([1.0, -1.0]), FULL)
    torch.testing.assert_close(loss, torch.tensor(0.1))  # (-0.5 - 1 - 1.2 + 0.8 + 1 + 1.5) / 6
    torch.testing.assert_close(metrics["policy/clip_frac"], torch.tensor(2 / 6))
    # approx kl = mean k3(log r) = mean(r - 1 - log r) = 2 * (0.5 - 1 + ln 2 + 0 + 0.5 - ln 1.5) / 6
    expected = 2 * (0.5 - 1 + LN2 + 0.5 - math.log(1.5)) / 6
    torch.testing.assert_close(metrics["policy/approx_kl"], torch.tensor(expected))


def test_clip_high_is_asymmetric() -> None:
    cfg = PolicyLossConfig(clip_low=0.2, clip_high=0.28)
    loss, _ = ppo_clip_token_loss(RATIOS.log(), torch.zeros(2, 3), torch.tensor([1.0, -1.0]), FULL, cfg)
    torch.testing.assert_close(loss[0, 2], torch.tensor(-1.28))


def test_on_policy_gradient_is_minus_advantage_over_tokens() -> None:
    logp = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    loss, _ = ppo_clip_loss(logp, None, None, torch.tensor([2.0]), torch.ones(1, 2, dtype=torch.bool))
    loss.backward()
    torch.testing.assert_close(loss, torch.tensor(-2.0))
    torch.testing.assert_close(logp.grad, torch.tensor([[-1.0, -1.0]]))


def test_agg_modes_differ_as_expected() -> None:
    nan = float("nan")
    loss = torch.tensor([[1.0, 2.0, 3.0, nan], [4.0, nan, nan, nan]])
    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0]], dtype=torch.bool)
    assert agg_loss(loss, mask, "token_mean").item() == pytest.approx(10 / 4)
    assert agg_loss(loss, mask, "seq_mean_token_mean").item() == pytest.approx((2 + 4) / 2)
    assert agg_loss(loss, mask, "seq_mean_token_sum").item() == pytest.approx((6 + 4) / 2)
    assert agg_loss(loss, mask, "seq_mean_token_sum_norm").item() == pytest.approx(5 / 4)
    with pytest.raises(ValueError, match="aggregation mode"):
        agg_loss(loss, mask, "sum")


def test_seq_mean_token_mean_skips_empty_sequences() -> None:
    mask = torch.tensor([[1, 1], [0, 0]], dtype=torch.bool)
    assert agg_loss(torch.tensor([[1.0, 3.0], [9.0, 9.0]]), mask, "seq_mean_token_mean").item() == 2.0


def test_kl_penalty_k3_off_by_default() -> None:
    logp = torch.full((1, 2), -1.0)
    ref = logp - LN2  # k3(ref - new) = exp(-ln 2) - 1 + ln 2
    args = (logp, None, None, torch.zeros(1), torch.ones(1, 2, dtype=torch.bool))
    off, m_off = ppo_clip_loss(*args, logp_ref=ref)
    on, m_on = ppo_clip_loss(*args, cfg=PolicyLossConfig(kl_coef=0.1), logp_ref=ref)
    assert off.item() == 0.0 and "policy/kl_ref" not in m_off
    torch.testing.assert_close(on, torch.tensor(0.1 * (0.5 - 1 + LN2)))
    torch.testing.assert_close(m_on["policy/kl_ref"], torch.tensor(0.5 - 1 + LN2))


def test_tis_weight_multiplies_token_loss() -> None:
    logp = torch.zeros(1, 2)
    rollout = -torch.tensor([[math.log(3.0), math.log(0.5)]])  # ratios 3 and 0.5
    cfg = PolicyLossConfig(correction=CorrectionConfig(name="tis", cap=2.0))
    loss, metrics = ppo_clip_loss(logp, None, rollout, torch.tensor([1.0]), torch.ones(1, 2, dtype=torch.bool), cfg)
    torch.testing.assert_close(loss, torch.tensor(-(2.0 + 0.5) / 2))
    torch.testing.assert_close(metrics["policy/correction_weight_mean"], torch.tensor(1.25))


def test_tis_and_mis_token_level() -> None:
    lt = torch.zeros(1, 4)
    lr = -torch.tensor([[math.log(3.0), math.log(0.5), 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 1, 0]], dtype=torch.bool)
    torch.testing.assert_close(tis_weights(lt, lr, mask, cap=2.0), torch.tensor([[2.0, 0.5, 1.0, 0.0]]))
    assert mis_mask(lt, lr, mask, low=0.5, high=2.0).tolist() == [[False, True, True, False]]
    weights = correction_weights(lt, lr, mask, CorrectionConfig(name="mis"))
    torch.testing.assert_close(weights, torch.tensor([[0.0, 0.5, 1.0, 0.0]]))


def test_icepop_masks_tokens_outside_the_band_and_keeps_the_rest_at_weight_one() -> None:
    # ratios 3, 0.5 (on the lower edge), 1.9, 0.4, 1 (padding)
    lt = torch.zeros(1, 5)
    lr = -torch.tensor([[math.log(3.0), math.log(0.5), math.log(1.9), math.log(0.4), 0.0]])
    mask = torch.tensor([[1, 1, 1, 1, 0]], dtype=torch.bool)
    assert icepop_mask(lt, lr, mask, bound=2.0).tolist() == [[False, True, True, False, False]]
    weights = correction_weights(lt, lr, mask, CorrectionConfig(name="icepop", bound=2.0))
    torch.testing.assert_close(weights, torch.tensor([[0.0, 1.0, 1.0, 0.0, 0.0]]))
    # a wider band keeps 3 and 0.4 as well
    wide = correction_weights(lt, lr, mask, CorrectionConfig(name="icepop", bound=5.0))
    torch.testing.assert_close(wide, torch.tensor([[1.0, 1.0, 1.0, 1.0, 0.0]]))
    with pytest.raises(ValueError, match="icepop bound must be > 1"):
        icepop_mask(lt, lr, mask, bound=1.0)


def test_icepop_loss_drops_masked_tokens_but_keeps_them_in_the_token_mean() -> None:
    logp = torch.zeros(1, 4)
    rollout = -torch.tensor([[math.log(3.0), 0.0, math.log(1.5), math.log(0.25)]])  # ratios 3, 1, 1.5, 0.25
    cfg = PolicyLossConfig(correction=CorrectionConfig(name="icepop", bound=2.0))
    loss, metrics = ppo_clip_loss(logp, None, rollout, torch.tensor([1.0]), torch.ones(1, 4, dtype=torch.bool), cfg)
    # on-policy PPO token loss is -A = -1; two kept tokens of four
    torch.testing.assert_close(loss, torch.tensor(-2.0 / 4))
    torch.testing.assert_close(metrics["policy/correction_masked_frac"], torch.tensor(0.5))
    torch.testing.assert_close(metrics["policy/correction_keep_frac"], torch.tensor(0.5))
    torch.testing.assert_close(metrics["policy/correction_weight_mean"], torch.tensor(0.5))


def test_sequence_and_geometric_levels() -> None:
    lt = torch.tensor([[LN2, LN2, 5.0]])  # third token is padding
    lr = torch.zeros(1, 3)
    mask = torch.tensor([[1, 1, 0]], dtype=torch.bool)
    # sequence ratio exp(2 ln 2) = 4, geometric exp(ln 2) = 2
    torch.testing.assert_close(tis_weights(lt, lr, mask, cap=3.0, level="sequence"), torch.tensor([[3.0, 3.0, 0.0]]))
    torch.testing.assert_close(tis_weights(lt, lr, mask, cap=3.0, level="geometric"), torch.tensor([[2.0, 2.0, 0.0]]))
    assert mis_mask(lt, lr, mask, 0.5, 3.0, level="sequence").tolist() == [[False, False, False]]
    assert mis_mask(lt, lr, mask, 0.5, 3.0, level="geometric").tolist() == [[True, True, False]]
    with pytest.raises(ValueError, match="level"):
        tis_weights(lt, lr, mask, level="batch")


def test_gspo_clips_whole_sequence() -> None:
    logp_new = torch.tensor([[LN2, 0.0]])  # sequence ratio exp(ln 2 / 2) = sqrt 2
    cfg = PolicyLossConfig(name="gspo", agg_mode="seq_mean_token_mean")
    loss, metrics = policy_loss(
        logp_new, torch.zeros(1, 2), None, torch.tensor([1.0]), torch.ones(1, 2, dtype=torch.bool), cfg
    )
    torch.testing.assert_close(loss, torch.tensor(-1.2))
    assert metrics["policy/clip_frac"].item() == 1.0


def test_registry_and_errors() -> None:
    assert set(POLICY_LOSSES) == {"ppo_clip", "gspo", "pg"}
    args = (torch.zeros(1, 2), None, None, torch.ones(1), torch.ones(1, 2, dtype=torch.bool))
    with pytest.raises(ValueError, match="policy loss"):
        policy_loss(*args, cfg=PolicyLossConfig(name="dpo"))
    with pytest.raises(ValueError, match="needs rollout logprobs"):
        policy_loss(*args, cfg=PolicyLossConfig(correction=CorrectionConfig(name="tis")))
    with pytest.raises(ValueError, match="correction"):
        policy_loss(*args, cfg=PolicyLossConfig(correction=CorrectionConfig(name="ois")))
    loss, _ = policy_loss(*args, cfg=PolicyLossConfig(name="pg"))
    assert loss.item() == -1.0
