"""The one definition of a block: `build_campaign_dag(recipe_path)` → a DAG whose run is one
block of the campaign.

    launch_ray ──► rollout ──► train ──► sync ──► evaluate ──► progress
         └──────────── teardown (all_done) ◄──────────────────────────┘
                       block_failed (one_failed): fails the run when a stage failed

progress applies the regression gate and triggers the run of the next block (see
milepost.dags.progress); teardown waits for it, so the lease is released last.

teardown is a leaf with trigger rule `all_done`, so it alone would decide the run's state
(success even when a stage failed); `block_failed` runs only when a stage failed and fails
the run, naming the stage (skipped, it leaves a good run a success).

Parse time reads only the recipe's YAML (for its name, description and retries): no
milepost.core, no torch/ray/transformers, no connection.
"""

from __future__ import annotations

import datetime as dt
from pathlib import Path
from typing import Any

import yaml
from airflow.sdk import DAG, BaseOperator, Param, TriggerRule
from milepost.dags.names import dag_id_for
from milepost.dags.operators import StageOperator
from milepost.dags.params import OVERRIDE_PATTERN, OVERRIDES_DESCRIPTION
from milepost.dags.progress import ProgressOperator

BLOCK_STAGES = ("launch_ray", "rollout", "train", "sync", "evaluate")
TAGS = ("milepost", "rl-campaign")


def _recipe_summary(path: Path) -> tuple[dict[str, Any], str]:
    """The recipe as YAML (unvalidated: validation runs in launch_ray) and its leading comment."""
    text = path.read_text()
    doc = yaml.safe_load(text) or {}
    if not isinstance(doc, dict):
        raise ValueError(f"{path}: a recipe is a YAML mapping, got {type(doc).__name__}")
    comment = []
    for line in text.splitlines():
        if not line.startswith("#"):
            break
        comment.append(line.lstrip("# ").rstrip())
    return doc, " ".join(comment)


def _doc_md(name: str, path: Path, description: str, num_blocks: Any, executor: str) -> str:
    return f"""\
### milepost campaign `{name}`

{description or 'An RL post-training campaign.'}

Recipe: `{path}` · blocks: {num_blocks} · executor: `{executor}`

**One run of this DAG is one block** of the campaign stored at `campaign_url`:
`launch_ray → rollout → train → sync → evaluate`, with `teardown` releasing the block's
allocation whatever happened. Every stage is a job (`python -m milepost.tasks.stage`) on
the recipe's executor (Slurm or local processes); the task defers while it runs, holding
no worker slot.

**Trigger with params:** `campaign_url` (store folder or fsspec URL), `block` (0-based),
`overrides` (`section.key=value` lines, as `milepost run --set`). The first run writes the
resolved recipe to the store; a later run without overrides uses it, one with overrides
must resolve to the same recipe (else launch_ray refuses it and says what changed).

**Progression:** after evaluate, the `progress` task applies the regression gate
(`campaign.max_eval_drop`) and triggers the next block's run (queued until this one ends),
until `campaign.num_blocks`. A regression pauses the campaign and marks the block
(`blocks/N/gate.json`); trigger the next block with `resume` to continue from the best
block's checkpoint. Two runs never write one campaign at once (`<campaign>/lease.json`).

**Retries are safe:** stages are idempotent and checkpointed; a retried train stage resumes
from its last committed checkpoint, and a stage already recorded `done` is not run again.
"""


def build_campaign_dag(recipe_path: str | Path, *, dag_id: str | None = None, campaign_url: str | None = None,
                       campaigns_root: str | Path = "runs", tags: tuple[str, ...] = (),
                       poll_interval_s: float = 5.0, retry_delay_s: float = 30.0) -> DAG:
    """One DAG for the campaign of `recipe_path`; its default `campaign_url` is
    `<campaigns_root>/<campaign.name>` (made absolute: workers do not share a cwd) unless given."""
    path = Path(recipe_path).resolve()
    doc, description = _recipe_summary(path)
    campaign = doc.get("campaign") or {}
    cluster = doc.get("cluster") or {}
    name = str(campaign.get("name") or path.stem)
    retries = int(cluster.get("max_block_retries", 1))
    default_url = campaign_url or str(Path(campaigns_root).resolve() / name)

    dag = DAG(
        dag_id=dag_id or dag_id_for(name),
        description=f"milepost campaign {name}: one run = one block",
        doc_md=_doc_md(name, path, description, campaign.get("num_blocks", "?"), cluster.get("executor", "local")),
        schedule=None,
        start_date=dt.datetime(2026, 1, 1, tzinfo=dt.timezone.utc),
        catchup=False,
        max_active_runs=1,  # two blocks of one campaign never run at once
        tags=sorted({*TAGS, f"recipe:{name}", *tags}),
        params={
            "campaign_url": Param(default_url, type="string", minLength=1, title="Campaign store",
                                  description="Folder or fsspec URL (s3://…) of the campaign store."),
            "block": Param(0, type="integer", minimum=0, title="Block",
                           description="Index of the block this run executes (0-based)."),
            "overrides": Param([], type="array", title="Recipe overrides", description=OVERRIDES_DESCRIPTION,
                               items={"type": "string", "pattern": OVERRIDE_PATTERN}),
            "resume": Param(False, type="boolean", title="Resume a paused campaign",
                            description="A campaign paused by its regression gate (or a stop request) runs "
                                        "its next block only with this set; after a regression that block "
                                        "starts from the best block's checkpoint."),
        },
        default_args={"retries": retries, "retry_delay": dt.timedelta(seconds=retry_delay_s)},
    )
    with dag:
        stages = [StageOperator(task_id=stage, stage=stage, recipe_path=str(path), poll_interval_s=poll_interval_s)
                  for stage in BLOCK_STAGES]
        for upstream, downstream in zip(stages, stages[1:]):
            upstream >> downstream
        teardown = StageOperator(task_id="teardown", stage="teardown", recipe_path=str(path),
                                 poll_interval_s=poll_interval_s, trigger_rule=TriggerRule.ALL_DONE, retries=1)
        progress = ProgressOperator(task_id="progress", retries=retries)
        stages[-1] >> progress >> teardown
        stages[0] >> teardown
        block_failed = BlockFailedOperator(task_id="block_failed", trigger_rule=TriggerRule.ONE_FAILED, retries=0)
        stages >> block_failed
    return dag


class BlockFailedOperator(BaseOperator):
    """Fails the run when a stage failed (runs only then: trigger rule one_failed)."""

    ui_color = "#f6dbdb"

    def execute(self, context: Any) -> None:
        raise RuntimeError(f"block {context['params']['block']}: a stage failed (the red task; its log says why). "
                           "Clear that task to retry it: the block resumes from its last checkpoint.")
