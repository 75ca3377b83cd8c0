"""Advantage estimators against hand-computed values."""

from __future__ import annotations

import math

import pytest
import torch

from milepost.core.algo.advantages import (
    ADVANTAGE_ESTIMATORS,
    compute_advantages,
    dr_grpo_advantages,
    grpo_advantages,
    reinforce_pp_advantages,
    rloo_advantages,
)
from milepost.core.config import AlgoConfig


def close(actual: torch.Tensor, expected: list) -> None:
    torch.testing.assert_close(actual, torch.tensor(expected), atol=1e-5, rtol=1e-5)


def test_grpo_normalises_each_group_by_its_mean_and_population_std() -> None:
    # group 0: [1, 0, 0, 1], mean 0.5, population std 0.5 -> [1, -1, -1, 1]
    # group 1: [2, 2, 2, 2], std 0 -> 0 / eps = [0, 0, 0, 0]
    adv = grpo_advantages(torch.tensor([[1.0, 0.0, 0.0, 1.0], [2.0, 2.0, 2.0, 2.0]]))
    close(adv, [[1.0, -1.0, -1.0, 1.0], [0.0, 0.0, 0.0, 0.0]])


def test_grpo_uses_population_not_sample_std() -> None:
    # [1, 2, 3]: mean 2, population var 2/3, std sqrt(2/3) -> +-1/sqrt(2/3) = +-sqrt(1.5)
    adv = grpo_advantages(torch.tensor([[1.0, 2.0, 3.0]]), eps=0.0)
    close(adv, [[-math.sqrt(1.5), 0.0, math.sqrt(1.5)]])


def test_grpo_accepts_integer_rewards() -> None:
    adv = grpo_advantages(torch.tensor([[1, 0]]), eps=0.0)
    close(adv, [[1.0, -1.0]])


def test_dr_grpo_subtracts_the_group_mean_without_std_normalisation() -> None:
    # group 0 mean 0.5; group 1 [3, 1, 2, 2] mean 2
    adv = dr_grpo_advantages(torch.tensor([[1.0, 0.0, 0.0, 1.0], [3.0, 1.0, 2.0, 2.0]]))
    close(adv, [[0.5, -0.5, -0.5, 0.5], [1.0, -1.0, 0.0, 0.0]])


def test_rloo_subtracts_the_mean_of_the_other_samples() -> None:
    # [1, 0, 0, 1]: 1 - (0+0+1)/3 = 2/3 ; 0 - (1+0+1)/3 = -2/3
    # [3, 1, 2]:   3 - 1.5 = 1.5 ; 1 - 2.5 = -1.5 ; 2 - 2 = 0
    close(rloo_advantages(torch.tensor([[1.0, 0.0, 0.0, 1.0]])), [[2 / 3, -2 / 3, -2 / 3, 2 / 3]])
    close(rloo_advantages(torch.tensor([[3.0, 1.0, 2.0]])), [[1.5, -1.5, 0.0]])


def test_rloo_gives_a_group_of_one_sample_zero_advantage_as_grpo_does() -> None:
    close(rloo_advantages(torch.tensor([[1.0], [0.0]])), [[0.0], [0.0]])
    close(grpo_advantages(torch.tensor([[1.0], [0.0]])), [[0.0], [0.0]])


def test_reinforce_pp_normalises_over_the_whole_batch_not_per_group() -> None:
    # batch [1, 0, 0, 3]: mean 1, deviations [0, -1, -1, 2], var 6/4 = 1.5, std sqrt(1.5)
    adv = reinforce_pp_advantages(torch.tensor([[1.0, 0.0], [0.0, 3.0]]), eps=0.0)
    s = math.sqrt(1.5)
    close(adv, [[0.0, -1 / s], [-1 / s, 2 / s]])


def test_estimators_reject_rewards_that_are_not_two_dimensional() -> None:
    with pytest.raises(ValueError, match=r"\[G, n\]"):
        grpo_advantages(torch.tensor([1.0, 0.0]))


def test_compute_advantages_dispatches_to_the_named_estimator() -> None:
    rewards = torch.tensor([[1.0, 0.0, 3.0], [2.0, 2.0, 5.0]])
    for name, fn in ADVANTAGE_ESTIMATORS.items():
        torch.testing.assert_close(compute_advantages(name, rewards), fn(rewards))


def test_every_registered_advantage_is_a_valid_recipe_value_and_grpo_stays_the_default() -> None:
    assert set(ADVANTAGE_ESTIMATORS) == {"grpo", "dr_grpo", "rloo", "reinforce_pp"}
    for name in ADVANTAGE_ESTIMATORS:
        assert AlgoConfig(advantage=name).advantage == name
    assert AlgoConfig().advantage == "grpo"


def test_unknown_advantage_name_gives_a_value_error_listing_the_known_names() -> None:
    with pytest.raises(ValueError) as err:
        compute_advantages("ppo_gae", torch.zeros(2, 2))
    message = str(err.value)
    assert "ppo_gae" in message
    for name in ("grpo", "dr_grpo", "rloo", "reinforce_pp"):
        assert name in message
