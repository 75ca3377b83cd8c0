"""The one definition of a block: `build_campaign_dag(recipe_path)` → a DAG whose run is one
block of the campaign.

    start_ray ──► start_engines ──► run_steps ──► publish ──► evaluate ──► progress
         └──────────────── teardown (all_done) ◄─────────────────────────────────┘
                       block_failed (one_failed): fails the run naming the stage (dags/block_failed.py)

progress applies the regression gate and triggers the run of the next block (see
milepost.dags.progress); teardown waits for it, so the lease is released last.

teardown is a leaf with trigger rule `all_done`, so it alone would decide the run's state
(success even when a stage failed); `block_failed` runs only when a stage failed and fails
the run, naming the stage (skipped, it leaves a good run a success).

Parse time reads only the recipe's YAML (for its name, description and retries) and the
stage names of milepost.core.records (standard library only): no recipe schema, no
torch/ray/transformers, no connection.
"""

from __future__ import annotations

import datetime as dt
import itertools
from pathlib import Path
from typing import Any

import yaml
from airflow.sdk import DAG, Param, TriggerRule

from milepost.core.records import BLOCK_STAGES, Stage, dag_id_for
from milepost.dags.block_failed import BlockFailedOperator
from milepost.dags.operators import StageOperator
from milepost.dags.params import OVERRIDE_ITEM, OVERRIDES_DESCRIPTION
from milepost.dags.progress import ProgressOperator

TAGS = ("milepost", "rl-campaign")


def _recipe_summary(path: Path) -> tuple[dict[str, Any], str]:
    """The recipe as YAML (unvalidated: validation runs in start_ray) and its leading comment."""
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


def _doc_md(name: str, path: Path, description: str, num_blocks: Any, steps_per_block: Any, executor: str) -> str:
    return f"""\
### milepost campaign `{name}`

{description or 'An RL post-training campaign.'}

Recipe: `{path}` · {num_blocks} blocks of {steps_per_block} RL steps · stage jobs run on: `{executor}`

**One run of this DAG is one block** of the campaign: a number of RL steps, then a
held-out evaluation. The campaign's state (recipe, checkpoints, metrics, what each stage did)
lives in its store (`campaign_url`), so any run can be retried or resumed.

| stage | what it does |
|---|---|
| `start_ray` | checks the recipe and the store (the first run writes the recipe there), takes the campaign's lease, starts the block's Ray cluster |
| `start_engines` | starts the inference engines that generate answers, loaded with the latest policy; the first block also measures the base policy |
| `run_steps` | runs the block's RL steps (each: rollout, score with the reward, train the model, sync the new weights to the engines), checkpointing as it goes |
| `publish` | exports the block's final checkpoint in Hugging Face format and checks the engines serve it |
| `evaluate` | measures held-out accuracy, applies the **regression gate**, logs the block's summary |
| `progress` | starts the next block's run (named `block_<N>__…`), unless the campaign is complete, paused or stopped |
| `teardown` | always runs: releases the cluster and the lease |
| `block_failed` | runs only when a stage failed: names it, its root error, and what to do |

**Params of the trigger form**
- **Campaign store** (`campaign_url`): the folder (or `s3://…` URL) where this campaign lives.
  Use a new one to start a new campaign; the same one to continue.
- **Block** (`block`): which block this run trains, counting from 0. Block 0 starts the
  campaign; each block's `progress` task triggers the next one for you.
- **Recipe overrides** (`overrides`, optional): changes to the recipe, one `section.key=value`
  per line, e.g. `train.lr=1e-4` or `campaign.steps_per_block=50`. Only the first run of a
  campaign may change the recipe: a campaign keeps the recipe it started with.
- **Resume a paused campaign** (`resume`): tick it to continue a campaign that the regression
  gate (or a stop request) paused; the block then starts from the best block's checkpoint.
- **Run ID** (the form's advanced options): name the first run after its block, e.g.
  `block_000000`; the runs that `progress` starts are named `block_<N>__…` already.

**What a finished run shows:** its **note** (on the run's page and in the runs list) is the
block's summary: steps, held-out accuracy against the block before (the base policy for
block 0), reward, the regression gate's verdict, checkpoint, wall time and the plot of the
campaign's curves (`<campaign>/blocks/<N>/report.png`), and the block's page
`<campaign>/blocks/<N>/report.html` (the table, the plot inside it, one row per step). The `evaluate`
and `progress` task logs end with the same table. Each stage task's log names its stage
job's own log, which holds what the stage printed (steps, rewards, accuracy, errors), and
shows its last lines.

**The regression gate:** a block whose accuracy falls more than `campaign.max_eval_drop`
below the best block's pauses the campaign (verdict `regressed`). Trigger the next block
with `resume` ticked to continue from the best block's checkpoint.

**When a run fails,** `block_failed`'s log and the run's note say which stage failed and why.
An error in the input (recipe, overrides, data, plugin) fails the same way every time:
trigger the DAG again with corrected overrides. A runtime error (a lost node, a killed job):
clear the failed task to retry it; it resumes from its last committed checkpoint. Retries
are safe: a stage already recorded done is not run again, and two runs never write one
campaign at once (`<campaign>/lease.json`).
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
        doc_md=_doc_md(name, path, description, campaign.get("num_blocks", "?"), campaign.get("steps_per_block", "?"),
                       cluster.get("executor", "local")),
        schedule=None,
        start_date=dt.datetime(2026, 1, 1, tzinfo=dt.UTC),
        catchup=False,
        max_active_runs=1,  # two blocks of one campaign never run at once
        tags=sorted({*TAGS, f"recipe:{name}", *tags}),
        params={
            "campaign_url": Param(default_url, type="string", minLength=1, title="Campaign store",
                                  description="Folder or fsspec URL (s3://…) of the campaign store."),
            "block": Param(0, type="integer", minimum=0, title="Block",
                           description="Index of the block this run executes (0-based)."),
            # "null" in the type: the form does not mark the field required (it may be empty).
            "overrides": Param([], type=["array", "null"], title="Recipe overrides", description=OVERRIDES_DESCRIPTION,
                               items=OVERRIDE_ITEM),
            "resume": Param(False, type="boolean", title="Resume a paused campaign",
                            description="A campaign paused by its regression gate (or a stop request) runs "
                                        "its next block only with this set; after a regression that block "
                                        "starts from the best block's checkpoint."),
        },
        default_args={"retries": retries, "retry_delay": dt.timedelta(seconds=retry_delay_s)},
    )
    with dag:
        stages = [StageOperator(task_id=stage.value, stage=stage.value, recipe_path=str(path),
                                poll_interval_s=poll_interval_s) for stage in BLOCK_STAGES]
        for upstream, downstream in itertools.pairwise(stages):
            upstream >> downstream
        teardown = StageOperator(task_id=Stage.TEARDOWN.value, stage=Stage.TEARDOWN.value, recipe_path=str(path),
                                 poll_interval_s=poll_interval_s, trigger_rule=TriggerRule.ALL_DONE,
                                 retries=3)  # idempotent; Airflow's false "Up For Retry" can hit it twice
        progress = ProgressOperator(task_id="progress", retries=retries)
        stages[-1] >> progress >> teardown
        stages[0] >> teardown
        block_failed = BlockFailedOperator(task_id="block_failed", trigger_rule=TriggerRule.ONE_FAILED, retries=0)
        stages >> block_failed
    return dag

