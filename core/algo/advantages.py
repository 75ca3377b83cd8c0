"""Advantage estimators: pure tensor functions from rewards to advantages.

Every estimator takes `rewards: Tensor[G, n]` (G prompt groups, n samples per prompt) and
returns advantages of the same shape and a floating dtype. Standard deviations are population
standard deviations (`unbiased=False`), so a group of identical rewards gets zero advantage and
the result does not depend on a Bessel correction.

`algo.advantage` names one of them or a user's estimator with the same signature (`AdvantageFn`),
resolved through `ADVANTAGE_ESTIMATORS`. The loop calls an estimator once per prompt group with
`rewards: [1, n]` (groups are ragged after filtering), except those in `WHOLE_BATCH`, which see
the step's rewards as one row `[1, N]`.
"""

from __future__ import annotations

from typing import Protocol

import torch
from torch import Tensor

from milepost.core.plugins import Registry


class AdvantageFn(Protocol):
    """`algo.advantage`: rewards [G, n] -> advantages [G, n], a floating dtype."""

    def __call__(self, rewards: Tensor) -> Tensor: ...


ADVANTAGE_ESTIMATORS: Registry[AdvantageFn] = Registry("algo.advantage", AdvantageFn)
# Estimators that normalise over the whole batch, not per group: the loop gives them one row.
WHOLE_BATCH = frozenset({"reinforce_pp"})


def _check_rewards(rewards: Tensor) -> Tensor:
    if rewards.ndim != 2:
        raise ValueError(f"rewards must have shape [G, n]; got shape {tuple(rewards.shape)}")
    return rewards if rewards.is_floating_point() else rewards.float()


@ADVANTAGE_ESTIMATORS.register("grpo")
def grpo_advantages(rewards: Tensor, eps: float = 1e-6) -> Tensor:
    """GRPO: (r - group mean) / (group population std + eps).

    rewards: [G, n] -> advantages: [G, n].
    """
    r = _check_rewards(rewards)
    mean = r.mean(dim=1, keepdim=True)
    std = r.std(dim=1, keepdim=True, unbiased=False)
    return (r - mean) / (std + eps)


@ADVANTAGE_ESTIMATORS.register("dr_grpo")
def dr_grpo_advantages(rewards: Tensor) -> Tensor:
    """Dr. GRPO: r - group mean, with no std normalisation.

    rewards: [G, n] -> advantages: [G, n].
    """
    r = _check_rewards(rewards)
    return r - r.mean(dim=1, keepdim=True)


@ADVANTAGE_ESTIMATORS.register("rloo")
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


@ADVANTAGE_ESTIMATORS.register("reinforce_pp")
def reinforce_pp_advantages(rewards: Tensor, eps: float = 1e-6) -> Tensor:
    """REINFORCE++: global normalisation over the whole batch,
    (r - batch mean) / (batch population std + eps).

    rewards: [G, n] -> advantages: [G, n].
    """
    r = _check_rewards(rewards)
    return (r - r.mean()) / (r.std(unbiased=False) + eps)


def compute_advantages(name: str, rewards: Tensor) -> Tensor:
    """Advantages for `rewards: [G, n]` with the estimator `name` (registered or an import path) -> [G, n].

    Raises PluginError (a ValueError) naming the known estimators when `name` is none of them.
    """
    return ADVANTAGE_ESTIMATORS.resolve(name)(rewards)
