"""Group-relative advantages: each prompt is sampled n times and rewards are compared within the group.

No critic is needed; the group mean is the baseline. `rewards` is laid out group-major (the n samples of
prompt 0, then of prompt 1, ...), which is how the rollout engine emits repeated prompts. The std used by
GRPO is the unbiased one (torch.std, as in verl and TRL).
"""

from __future__ import annotations

from collections.abc import Callable

from torch import Tensor

from trace_lightning.rl.registry import lookup

AdvantageFn = Callable[[Tensor, int], Tensor]


def _grouped(rewards: Tensor, group_size: int) -> Tensor:
    """View [B] rewards as [B / group_size, group_size] in float32."""
    if rewards.dim() != 1:
        raise ValueError(f"rewards must be 1-D [B], got shape {tuple(rewards.shape)}")
    if group_size < 1 or rewards.numel() % group_size:
        raise ValueError(f"{rewards.numel()} rewards do not split into groups of {group_size}")
    return rewards.float().view(-1, group_size)


def group_advantages(rewards: Tensor, group_size: int, normalize_std: bool = True, eps: float = 1e-6) -> Tensor:
    """GRPO advantage: reward minus its group's mean, optionally divided by the group's std.

    rewards: [B] with B = G * group_size, group-major. Returns [B] float32.
    A group whose rewards are all equal gets 0 (so does a group of one).
    """
    r = _grouped(rewards, group_size)  # (G, n)
    centered = r - r.mean(dim=1, keepdim=True)
    if normalize_std and group_size > 1:
        centered = centered / (r.std(dim=1, keepdim=True) + eps)  # unbiased std
    return centered.reshape(-1)


def grpo_advantages(rewards: Tensor, group_size: int) -> Tensor:
    """(r - mean) / (std + eps) within each group. rewards: [B] -> [B]."""
    return group_advantages(rewards, group_size, normalize_std=True)


def dr_grpo_advantages(rewards: Tensor, group_size: int) -> Tensor:
    """Dr. GRPO: r - mean within each group, without the std division (no difficulty bias). [B] -> [B]."""
    return group_advantages(rewards, group_size, normalize_std=False)


def rloo_advantages(rewards: Tensor, group_size: int) -> Tensor:
    """REINFORCE leave-one-out: r_i minus the mean of the other n - 1 rewards of its group. [B] -> [B].

    Equals n / (n - 1) * (r_i - mean); needs group_size >= 2.
    """
    if group_size < 2:
        raise ValueError("rloo needs group_size >= 2")
    r = _grouped(rewards, group_size)  # (G, n)
    others = (r.sum(dim=1, keepdim=True) - r) / (group_size - 1)
    return (r - others).reshape(-1)


ADVANTAGES: dict[str, AdvantageFn] = {
    "grpo": grpo_advantages,
    "dr_grpo": dr_grpo_advantages,
    "rloo": rloo_advantages,
}


def compute_advantages(name: str, rewards: Tensor, group_size: int) -> Tensor:
    """Advantages by registry name ("grpo", "dr_grpo", "rloo"). rewards: [B] -> [B]."""
    return lookup(ADVANTAGES, name, "advantage estimator")(rewards, group_size)
