"""A campaign's inputs checked and its store prepared, before any block runs (by `milepost
run`'s embedded runner, milepost/run_cmd.py, or the DAG's start_ray task).

Validation (recipe, model path, datasets row by row, every plugin's import path and signature) happens
before anything is written to the store, so bad input exits 2 with nothing written.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

from milepost.core.config import Recipe
from milepost.core.data.arith import check_builtin_dataset
from milepost.core.data.source import PromptLimit, load_rows
from milepost.core.errors import UserError
from milepost.core.extensions import resolve_extensions
from milepost.core.model.loading import check_model_path, validation_tokenizer
from milepost.core.model.moe import check_routing_replay
from milepost.core.quant.modes import check_precision, local_device
from milepost.core.recipe_io import RecipeError, dump_recipe, recipe_diff, same_recipe
from milepost.core.records import RECIPE_DOC, check_campaign_url
from milepost.core.store import CampaignStore


@dataclass(frozen=True)
class PreparedCampaign:
    recipe: Recipe
    store: CampaignStore


def _check_dataset(path: str, key: str, recipe: Recipe, limit: Callable[[], PromptLimit | None]) -> None:
    if path.startswith("builtin:"):
        check_builtin_dataset(path, key)
        return  # generated deterministically on first use, prompts of a few tokens
    load_rows(path, recipe.data.prompt_key, recipe.data.label_key, setting=key, prompt_limit=limit)


def _prompt_limit(recipe: Recipe) -> PromptLimit | None:
    """The longest prompt the run takes: rollout.max_prompt_tokens, and the model's context
    less max_new_tokens when that is smaller. None for a remote model (its tokenizer would
    need the checkpoint copied first)."""
    found = validation_tokenizer(recipe.model)
    if found is None:
        return None
    tokenizer, context = found
    limit = recipe.rollout.max_prompt_tokens
    setting = f"rollout.max_prompt_tokens={limit}"
    longest_new = max(recipe.rollout.max_new_tokens, recipe.eval.max_new_tokens)
    if context is not None and context - longest_new < limit:
        if context - longest_new < 1:
            raise UserError(f"max_new_tokens={longest_new} (rollout/eval) leaves no room for a prompt in the "
                            f"model's context of {context} tokens; lower rollout.max_new_tokens/eval.max_new_tokens")
        limit = context - longest_new
        setting = (f"{limit} tokens (the model's context of {context} less max_new_tokens={longest_new}, "
                   f"below rollout.max_prompt_tokens={recipe.rollout.max_prompt_tokens})")
    return PromptLimit(tokenizer, limit, setting)


def _check_catalog(recipe: Recipe) -> None:
    """`model.catalog` only matters to `milepost plan`, but a name it would refuse is a typo now."""
    if recipe.model.catalog is None:
        return
    from milepost.core.plan.catalog import CATALOG
    if recipe.model.catalog not in CATALOG:
        raise UserError(f"model.catalog `{recipe.model.catalog}` is not a shipped config; known: "
                        f"{', '.join(CATALOG)} (`milepost plan --models` lists them), or leave it out")


def validate_resources(recipe: Recipe) -> None:
    """Everything that can be checked without starting a process: the model path, the
    datasets (every row, prompt lengths), every plugin (rollout, reward, advantage, loss,
    filters, hooks: loaded and checked against its signature)."""
    check_model_path(recipe.model)
    check_routing_replay(recipe)
    check_precision(recipe, local_device if recipe.cluster.executor == "local" else None)
    _check_catalog(recipe)
    limit = functools.cache(lambda: _prompt_limit(recipe))  # loaded once, after the rows passed
    _check_dataset(recipe.data.train_path, "data.train_path", recipe, limit)
    _check_dataset(recipe.data.eval_path, "data.eval_path", recipe, limit)
    resolve_extensions(recipe)


def prepare_campaign(recipe: Recipe, url: str) -> PreparedCampaign:
    """Validates everything first; only then writes (or checks) the stored recipe, so bad
    input leaves no trace in the store."""
    check_campaign_url(url)
    validate_resources(recipe)
    store = CampaignStore(url)
    resolved = dump_recipe(recipe)
    if store.is_campaign():
        stored = store.read_text(RECIPE_DOC)
        if not same_recipe(stored, recipe):
            raise RecipeError(
                f"campaign {url} was started with a different recipe; resume it with the same "
                f"recipe, or pass a new --campaign. What changed:\n{recipe_diff(stored, resolved)}")
    else:
        store.write_text_atomic(RECIPE_DOC, resolved)
    return PreparedCampaign(recipe=recipe, store=store)
