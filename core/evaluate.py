"""Held-out evaluation: greedy decoding through the fleet, scored by the recipe's reward."""

from __future__ import annotations

from typing import TYPE_CHECKING

from milepost.core.config import Recipe
from milepost.core.data.arith import either_form_correct, is_builtin_arith
from milepost.core.data.source import DataCursor, PromptSource, load_rows
from milepost.core.model.loading import load_tokenizer
from milepost.core.reward import RewardEvaluator, resolve_reward_fn
from milepost.core.rollout import RolloutRequest, default_rollout, sampling_params_from

if TYPE_CHECKING:
    from milepost.core.fleet.fleet import Fleet


def evaluate_fleet(recipe: Recipe, fleet: Fleet, model_path: str) -> dict[str, float]:
    tokenizer = load_tokenizer(model_path)
    rows = load_rows(recipe.data.eval_path, recipe.data.prompt_key, recipe.data.label_key,
                     builtin_rows=recipe.data.num_eval_rows, seed=recipe.seed)
    num = min(recipe.eval.num_prompts, len(rows))
    source = PromptSource(rows, tokenizer, DataCursor(0, 0, 0, len(rows)), shuffle=False,
                          prompt_key=recipe.data.prompt_key, label_key=recipe.data.label_key)
    request = RolloutRequest(
        prompts=source.next_batch(num), num_samples_per_prompt=1,
        sampling_params=sampling_params_from(recipe.rollout, [tokenizer.eos_token_id], greedy=True,
                                             max_new_tokens=recipe.eval.max_new_tokens),
        sampling_seed=0, num_engines=recipe.rollout.num_engines,
        decode=lambda ids: tokenizer.decode(ids, skip_special_tokens=True))
    samples = default_rollout(request, fleet.router_client)
    rewards = RewardEvaluator(resolve_reward_fn(recipe.reward.function), recipe.reward.num_workers)
    scores = rewards.score(samples)
    result = {"accuracy": sum(1.0 for s in scores if s > 0.5) / max(1, len(scores)),
              "num_prompts": float(len(scores))}
    if is_builtin_arith(recipe.data.eval_path):  # the value right whatever the form (core/data/arith.py)
        right = sum(either_form_correct(s.response_text, s.label) for s in samples)
        result["either_form"] = right / max(1, len(samples))
    return result


def record_base_eval(recipe: Recipe, fleet: Fleet, model_path: str) -> dict[str, float]:
    """The base policy's accuracy, measured once before any RL step."""
    return evaluate_fleet(recipe, fleet, model_path)
