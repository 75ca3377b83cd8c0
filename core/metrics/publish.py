"""The campaign's sinks, opened from its recipe, and the committed rows they are fed.

Train rows come from the loop's state at a checkpoint commit (tasks/run_steps.py); eval rows from
the store: the base policy's eval at step 0 and each evaluated block's at its last step."""

from __future__ import annotations

import logging
import os
import posixpath
from typing import Any

from milepost.core.config import Recipe
from milepost.core.metrics.sinks import MetricSink, SinkSet
from milepost.core.records import STEPS_STARTS_DOC, block_path
from milepost.core.store import CampaignStore

log = logging.getLogger(__name__)


def open_sinks(recipe: Recipe, store: CampaignStore) -> SinkSet:
    """The recipe's sinks beyond jsonl (which the run_steps stage writes itself); empty when none.
    A sink that cannot be opened (a tracking server down) is left out of this stage with a
    warning, not fatal: the next stage reads back what it holds and catches up."""
    sinks: list[MetricSink] = []
    for name in recipe.metrics.sinks:
        try:
            if name == "tensorboard":
                from milepost.core.metrics.tensorboard_sink import TensorBoardSink

                sinks.append(TensorBoardSink(store.local_path("metrics", "tensorboard")))
            elif name == "mlflow":
                sinks.append(_mlflow_sink(recipe, store))
            elif name == "wandb":
                sinks.append(_wandb_sink(recipe, store))
        except Exception as e:  # noqa: BLE001 - see the docstring
            log.warning("metrics sink %s could not be opened (%s: %s); this stage writes no metrics to it, "
                        "a later stage catches up", name, type(e).__name__, e)
    return SinkSet(sinks)


def _mlflow_sink(recipe: Recipe, store: CampaignStore) -> MetricSink:
    from milepost.core.metrics.mlflow_sink import MlflowSink, default_tracking_uri

    config = recipe.metrics.mlflow
    local = config.tracking_uri is None
    uri = (default_tracking_uri(store.local_path("metrics", "mlflow")) if config.tracking_uri is None
           else config.tracking_uri)
    artifacts = store.local_path("metrics", "mlflow", "artifacts") if local else None
    return MlflowSink(uri, config.experiment or recipe.campaign.name, campaign_url=store.url,
                      run_name=posixpath.basename(store.url) or recipe.campaign.name,
                      artifact_location=artifacts, params=recipe_params(recipe))


def _wandb_sink(recipe: Recipe, store: CampaignStore) -> MetricSink:
    from milepost.core.metrics.mlflow_sink import campaign_id
    from milepost.core.metrics.wandb_sink import WandbSink

    # W&B's own variable names the project when set (as for any W&B run); else the campaign's name.
    project = os.environ.get("WANDB_PROJECT") or recipe.campaign.name
    return WandbSink(store.local_path("metrics", "wandb"), project, run_id=campaign_id(store.url),
                     run_name=posixpath.basename(store.url) or recipe.campaign.name, config=recipe_params(recipe))


def recipe_params(recipe: Recipe) -> dict[str, str]:
    """The recipe flattened to `section.key` → text: what a run is compared by in a tracker."""
    out: dict[str, str] = {}

    def walk(prefix: str, node: Any) -> None:
        if isinstance(node, dict):
            for k, v in node.items():
                walk(f"{prefix}.{k}" if prefix else k, v)
        else:
            out[prefix] = str(node)[:6000]  # MLflow's limit on a param value

    walk("", recipe.model_dump(mode="json"))
    return out


def eval_rows(store: CampaignStore, steps_per_block: int) -> list[dict[str, Any]]:
    """`eval/<metric>` rows: the base policy at step 0, each evaluated block at its last step."""
    rows = []
    if store.exists("base_eval.json"):
        rows.append({"step": 0, **_prefixed(store.read_json("base_eval.json"))})
    for block in store.block_indices():
        evaluation = store.block_eval(block)
        if evaluation is not None:
            rows.append(eval_row((block + 1) * steps_per_block, evaluation))
    return rows


def eval_row(step: int, evaluation: dict[str, Any]) -> dict[str, Any]:
    return {"step": step, **_prefixed(evaluation)}


def _prefixed(evaluation: dict[str, Any]) -> dict[str, Any]:
    return {f"eval/{k}": v for k, v in evaluation.items()}


def publish_eval(recipe: Recipe, store: CampaignStore, step: int, evaluation: dict[str, Any]) -> None:
    """The evaluate stage's result (and any earlier eval a killed stage left out) to the sinks.
    A rerun of the stage measures the same greedy eval of the same weights; what the sinks
    already hold is not written again."""
    _publish(recipe, store, eval_rows(store, recipe.campaign.steps_per_block) + [eval_row(step, evaluation)])


def publish_committed(recipe: Recipe, store: CampaignStore, rows: list[dict[str, Any]]) -> None:
    """A checkpoint's step rows (and the evals so far) to the sinks that lack them: a stage
    killed after a checkpoint committed and before its sinks took the steps left them out,
    and a rerun that has no step left to train must still write them."""
    _publish(recipe, store, rows + eval_rows(store, recipe.campaign.steps_per_block))


def _publish(recipe: Recipe, store: CampaignStore, rows: list[dict[str, Any]]) -> None:
    """`rows` to the recipe's sinks beyond jsonl, each (step, tag) a sink lacks written once."""
    if len(recipe.metrics.sinks) == recipe.metrics.sinks.count("jsonl"):
        return
    sinks = open_sinks(recipe, store)
    try:
        sinks.publish(rows)
    finally:
        sinks.close()


def record_train_start(store: CampaignStore, block: int, from_step: int) -> None:
    """Append to blocks/<n>/train_starts.json: when a run_steps stage (first or resumed) began
    and from which committed step, so a plot can mark restarts."""
    import time

    rel = block_path(block, STEPS_STARTS_DOC)
    starts = store.read_json(rel) if store.exists(rel) else []
    starts.append({"at": time.time(), "from_step": from_step})
    store.write_json(rel, starts)
