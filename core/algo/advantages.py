"""Advantage estimators: pure tensor functions from rewards to advantages.

Every estimator takes `rewards: Tensor[G, n]` (G prompt groups, n samples per prompt) and
returns advantages of the same shape and a floating dtype. Standard deviations are population
standard deviations (`unbiased=False`), so a group of identical rewards gets zero advantage and
the result does not depend on a Bessel correction.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import Tensor

AdvantageFn = Callable[[Tensor], Tensor]


def _check_rewards(rewards: Tensor) -> Tensor:
    if rewards.ndim != 2:
        raise ValueError(f"rewards must have shape [G, n]; got shape {tuple(rewards.shape)}")
    return rewards if rewards.is_floating_point() else rewards.float()


def grpo_advantages(rewards: Tensor, eps: float = 1e-6) -> Tensor:
    """GRPO: (r - group mean) / (group population std + eps).

    rewards: [G, n] -> advantages: [G, n].
    """
    r = _check_rewards(rewards)
    mean = r.mean(dim=1, keepdim=True)
    std = r.std(dim=1, keepdim=True, unbiased=False)
    return (r - mean) / (std + eps)


def dr_grpo_advantages(rewards: Tensor) -> Tensor:
    """Dr. GRPO: r - group mean, with no std normalisation.

    rewards: [G, n] -> advantages: [G, n].
    """
    r = _check_rewards(rewards)
    return r - r.mean(dim=1, keepdim=True)


def rloo_advantages(rewards: Tensor) -> Tensor:
    """RLOO: r_i - mean of the other n - 1 rewards of the same group.

    A group of one sample (filters can leave one) has no baseline to compare with: its
    advantage is 0, as GRPO gives it, and the sample carries no gradient.

    rewards: [G, n] -> advantages: [G, n].
    """
    r = _check_rewards(rewards)
    n = r.shape[1]
    if n < 2:
        return torch.zeros_like(r)
    others_mean = (r.sum(dim=1, keepdim=True) - r) / (n - 1)
    return r - others_mean


def reinforce_pp_advantages(rewards: Tensor, eps: float = 1e-6) -> Tensor:
    """REINFORCE++: global normalisation over the whole batch,
    (r - batch mean) / (batch population std + eps).

    rewards: [G, n] -> advantages: [G, n].
    """
    r = _check_rewards(rewards)
    return (r - r.mean()) / (r.std(unbiased=False) + eps)


ADVANTAGE_ESTIMATORS: dict[str, AdvantageFn] = {
    "grpo": grpo_advantages,
    "dr_grpo": dr_grpo_advantages,
    "rloo": rloo_advantages,
    "reinforce_pp": reinforce_pp_advantages,
}


def compute_advantages(name: str, rewards: Tensor) -> Tensor:
    """Advantages for `rewards: [G, n]` with the estimator called `name` -> [G, n].

    Raises ValueError naming the known estimators when `name` is not one of them.
    """
    fn = ADVANTAGE_ESTIMATORS.get(name)
    if fn is None:
        known = ", ".join(sorted(ADVANTAGE_ESTIMATORS))
        raise ValueError(f"unknown advantage estimator `{name}`; known: {known}")
    return fn(rewards)
