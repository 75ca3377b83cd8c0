"""A campaign on the embedded defaults: validate everything, then run its blocks through the
campaign's Airflow DAG in-process (see tasks.airflow_local).

Validation (recipe, model path, datasets row by row, every plugin's import path and signature) happens
before anything is written to the store, so bad input exits 2 with nothing written.
"""

from __future__ import annotations

import functools
import logging
import os
import subprocess
import time
from dataclasses import dataclass
from typing import Callable

from milepost.core.config import Recipe
from milepost.core.data.arith import check_builtin_dataset
from milepost.core.data.source import PromptLimit, load_rows
from milepost.core.errors import UserError
from milepost.core.extensions import resolve_extensions
from milepost.core.model.loading import check_model_path, validation_tokenizer
from milepost.core.model.moe import check_routing_replay
from milepost.core.quant.modes import check_precision, local_device
from milepost.core.recipe_io import RecipeError, dump_recipe, recipe_diff, same_recipe
from milepost.core.records import (
    BLOCK_STAGES,
    RECIPE_DOC,
    Stage,
    StageRecord,
    campaign_id,
    check_campaign_url,
    dag_id_for,
)
from milepost.core.store import CampaignStore

log = logging.getLogger(__name__)


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


def run_campaign(prepared: PreparedCampaign, show_progress: bool = True, resume: bool = False) -> int:
    """Run the campaign's remaining blocks through its Airflow DAG, in-process (embedded mode,
    see tasks.airflow_local), under the campaign's lease. Returns an exit status of
    tasks.airflow_local: 0 done, 3 paused or stopped, 1 a block failed.

    Raises LeaseHeldError (another run writes the campaign) or CampaignPaused (paused or
    stopped and not `resume`) before any block starts."""
    from milepost.tasks.airflow_local import EXIT_DONE, child_command, embedded_env
    from milepost.tasks.lease import LeaseKeeper, local_owner
    from milepost.tasks.progression import check_can_start, next_block

    recipe, store = prepared.recipe, prepared.store
    owner = local_owner()
    with LeaseKeeper(store, owner):
        block = next_block(store, recipe)
        if block is None:
            log.info("campaign %s is complete (%d blocks)", store.url, recipe.campaign.num_blocks)
            return EXIT_DONE
        check_can_start(store, recipe, block, resume)
        url = campaign_id(store.url)
        dag_id = dag_id_for(recipe.campaign.name)
        child = subprocess.Popen(child_command(url, dag_id), env=embedded_env(store, dag_id, os.getpid(), owner))
        try:
            _follow(store, recipe, child, show_progress)
        finally:
            if child.poll() is None:  # interrupted: the child's stage jobs die with this process
                child.terminate()
            child.wait()
        return child.returncode


def _follow(store: CampaignStore, recipe: Recipe, child: subprocess.Popen, show_progress: bool) -> None:
    """What `milepost run` shows while the DAG runs: where each block's task log is, each stage
    as it finishes, each block's held-out accuracy, and (on a terminal) a progress line of the
    running stage with its rate and ETA (tasks/progress.py)."""
    from milepost.tasks.airflow_local import block_log
    from milepost.tasks.progress import ProgressLine, current_line
    from milepost.tasks.progression import next_block

    shown: set[tuple[int, str]] = set()
    current = None
    line = ProgressLine() if show_progress else None
    while True:
        running = child.poll() is None
        for b in () if current is None else (current,):
            for stage in BLOCK_STAGES:
                record = store.stage_record(b, stage)
                if record and record.done and (b, stage) not in shown:
                    shown.add((b, stage))
                    if line:
                        line.clear()
                    log.info("block %d: %s done (%.1fs)", b, stage, record.duration_s or 0.0)
                    if stage is Stage.EVALUATE:
                        _report_eval(store, recipe, b, record)
        block = next_block(store, recipe) if running else None
        if block is not None and block != current:
            current = block
            if line:
                line.clear()
            log.info("block %d (last: %d) runs as one run of the campaign's Airflow DAG, in this process; "
                     "its task log: %s", block, recipe.campaign.num_blocks - 1, block_log(store, block))
        if line and current is not None:
            line.show(current_line(store, current, recipe.campaign.steps_per_block))
        if not running:
            break
        time.sleep(1.0)
    if line:
        line.clear()


def _report_eval(store: CampaignStore, recipe: Recipe, block: int, record: StageRecord) -> None:
    accuracy = record.outputs["eval"]["accuracy"]
    base = store.read_json("base_eval.json")["accuracy"] if store.exists("base_eval.json") else None
    versus = f" (base policy {base:.3f}, {accuracy - base:+.3f})" if base is not None else ""
    log.info("block %d (last: %d): held-out accuracy %.3f%s", block, recipe.campaign.num_blocks - 1, accuracy, versus)
