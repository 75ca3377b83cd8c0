"""A campaign on the embedded defaults: validate everything, then run each block's stages.

Validation (recipe, datasets, reward and rollout import paths) happens before anything is
written to the store, so bad input exits 2 with nothing written.
"""

from __future__ import annotations

from dataclasses import dataclass

from milepost.core.config import Recipe
from milepost.core.data.source import load_rows
from milepost.core.recipe_io import RecipeError, dump_recipe, recipe_diff
from milepost.core.reward import resolve_reward_fn
from milepost.core.rollout import resolve_rollout_fn
from milepost.core.store import CampaignStore


@dataclass(frozen=True)
class PreparedCampaign:
    recipe: Recipe
    store: CampaignStore


def _check_dataset(path: str, key: str, recipe: Recipe) -> None:
    if path.startswith("builtin:"):
        return  # generated deterministically on first use
    load_rows(path, recipe.data.prompt_key, recipe.data.label_key, setting=key)


def validate_resources(recipe: Recipe) -> None:
    """Everything that can be checked without starting a process."""
    _check_dataset(recipe.data.train_path, "data.train_path", recipe)
    _check_dataset(recipe.data.eval_path, "data.eval_path", recipe)
    resolve_reward_fn(recipe.reward.function)
    resolve_rollout_fn(recipe.rollout.function)


def prepare_campaign(recipe: Recipe, url: str) -> PreparedCampaign:
    validate_resources(recipe)
    store = CampaignStore(url)
    resolved = dump_recipe(recipe)
    if store.exists("campaign.yaml"):
        stored = store.read_text("campaign.yaml")
        if stored != resolved:
            raise RecipeError(
                f"campaign {url} was started with a different recipe; resume it with the same "
                f"recipe, or pass a new --campaign. What changed:\n{recipe_diff(stored, resolved)}")
    else:
        store.write_text_atomic("campaign.yaml", resolved)
    return PreparedCampaign(recipe=recipe, store=store)


def run_campaign(prepared: PreparedCampaign, show_progress: bool = True) -> None:
    from milepost.tasks.block import BlockRunner

    runner = BlockRunner(prepared.recipe, prepared.store, show_progress=show_progress)
    for block in range(prepared.recipe.campaign.num_blocks):
        runner.run_block(block)
