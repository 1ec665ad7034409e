"""Group advantages against hand-computed values."""

import math

import pytest
import torch

from trace_lightning.rl import ADVANTAGES, compute_advantages, group_advantages

S = 1 / math.sqrt(2)  # 0.5 / unbiased std of {1, 0}


def test_grpo_two_groups_of_two() -> None:
    adv = compute_advantages("grpo", torch.tensor([1.0, 0.0, 0.0, 1.0]), group_size=2)
    torch.testing.assert_close(adv, torch.tensor([S, -S, -S, S]), atol=1e-5, rtol=0)


def test_dr_grpo_skips_std() -> None:
    adv = compute_advantages("dr_grpo", torch.tensor([1.0, 0.0, 0.0, 1.0]), group_size=2)
    torch.testing.assert_close(adv, torch.tensor([0.5, -0.5, -0.5, 0.5]))
    assert torch.equal(adv, group_advantages(torch.tensor([1.0, 0.0, 0.0, 1.0]), 2, normalize_std=False))


def test_rloo_leave_one_out() -> None:
    adv = compute_advantages("rloo", torch.tensor([1.0, 0.0, 0.0, 0.0, 1.0, 0.0, 0.0, 1.0]), group_size=4)
    torch.testing.assert_close(adv, torch.tensor([1.0, -1 / 3, -1 / 3, -1 / 3, 2 / 3, -2 / 3, -2 / 3, 2 / 3]))


def test_grpo_group_of_four_and_constant_group() -> None:
    # group 0: {3, 1, 1, 1}: mean 1.5, unbiased std 1 -> (1.5, -0.5, -0.5, -0.5); group 1 constant -> 0.
    adv = group_advantages(torch.tensor([3.0, 1.0, 1.0, 1.0, 0.7, 0.7, 0.7, 0.7]), 4)
    torch.testing.assert_close(adv, torch.tensor([1.5, -0.5, -0.5, -0.5, 0, 0, 0, 0]), atol=1e-5, rtol=0)


@pytest.mark.parametrize("name", ["grpo", "dr_grpo"])
def test_group_of_one_is_zero(name: str) -> None:
    assert torch.equal(compute_advantages(name, torch.tensor([1.0, 0.0]), 1), torch.zeros(2))


def test_errors() -> None:
    with pytest.raises(ValueError, match="groups of 3"):
        group_advantages(torch.ones(4), 3)
    with pytest.raises(ValueError, match="known: \\['dr_grpo', 'grpo', 'rloo'\\]"):
        compute_advantages("ppo", torch.ones(4), 2)
    with pytest.raises(ValueError):
        ADVANTAGES["rloo"](torch.ones(4), 1)
