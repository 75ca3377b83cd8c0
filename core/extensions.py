"""Every extension point a recipe names, resolved and checked in one place.

`resolve_extensions` is called at start-up (before anything is written: a bad plugin exits 2)
and again by the run_steps stage, which runs the loop with what it returns. The policy loss runs
in the trainer ranks, which resolve `algo.loss` themselves (core/algo/losses.py): here it is
only checked, and `trainer_algo` hands the ranks a spec that works from any folder.
"""

from __future__ import annotations

from dataclasses import dataclass

from milepost.core.algo.advantages import ADVANTAGE_ESTIMATORS, AdvantageFn
from milepost.core.algo.losses import POLICY_LOSSES
from milepost.core.config import AlgoConfig, Recipe
from milepost.core.filters import FilterChain
from milepost.core.hooks import Hooks
from milepost.core.plugins import portable_spec
from milepost.core.reward import RewardFn, resolve_reward_fn
from milepost.core.rollout import RolloutFn, resolve_rollout_fn


@dataclass(frozen=True)
class Extensions:
    rollout: RolloutFn
    reward: RewardFn
    advantage: AdvantageFn
    filters: FilterChain
    hooks: Hooks


def resolve_extensions(recipe: Recipe) -> Extensions:
    """Resolves every plugin of `recipe`; raises PluginError (exit 2) naming the first bad one."""
    extensions = Extensions(rollout=resolve_rollout_fn(recipe.rollout.function),
                            reward=resolve_reward_fn(recipe.reward.function),
                            advantage=ADVANTAGE_ESTIMATORS.resolve(recipe.algo.advantage),
                            filters=FilterChain.from_config(recipe.filters),
                            hooks=Hooks.from_config(recipe.hooks))
    POLICY_LOSSES.resolve(recipe.algo.loss)
    return extensions


def trainer_algo(algo: AlgoConfig) -> AlgoConfig:
    """`algo` as the trainer ranks get it: a relative `file.py` loss made absolute (a rank
    actor may run in another folder than the stage that starts it)."""
    return algo.model_copy(update={"loss": portable_spec(algo.loss)})
