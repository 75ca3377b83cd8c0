"""The operator of every block stage: submit `python -m milepost.tasks.stage` for one stage
through the executor interface of `slurm/`, then defer to `StageJobTrigger` until the job
ends (no worker slot held meanwhile), then check the outcome.

Stages are idempotent and checkpointed, so an Airflow retry simply submits the stage again:
a stage whose record says `done` is not submitted at all (its recorded outputs stand; the
task succeeds at once), and a partial one resumes from the store. Only identifiers go to
XCom: the campaign URL, the block index, the stage and its job id.

Imports here are Airflow's SDK and the standard library; milepost's recipe schema (pydantic),
the store (fsspec) and the executors (submitit) are imported inside `execute`, never when
the DAG file is parsed.
"""

from __future__ import annotations

import os
import sys
import time
from typing import Any

from airflow.sdk import BaseOperator


# = milepost.tasks.stage.DRIVER_PID_ENV (not imported: that module pulls in the engine; a test
# keeps the two equal).
DRIVER_PID_ENV = "MILEPOST_DRIVER_PID"


class StageFailedError(RuntimeError):
    """A stage job ended without recording the stage done; the message says where its log is."""


def stage_command(campaign_url: str, block: int, stage: str) -> list[str]:
    return [sys.executable, "-m", "milepost.tasks.stage", "--campaign", campaign_url, "--block", str(block),
            "--stage", stage]


class StageOperator(BaseOperator):
    """One stage of one block. `recipe_path` is the DAG's recipe: launch_ray writes the
    campaign (recipe + the run's overrides) to the store on first use, or checks that the
    stored one is the same; the other stages read it from the store."""

    ui_color = "#dbe8f6"

    def __init__(self, *, stage: str, recipe_path: str, poll_interval_s: float = 5.0, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.stage = stage
        self.recipe_path = recipe_path
        self.poll_interval_s = poll_interval_s

    # --- identifiers from the run's params ----------------------------------------------------
    @staticmethod
    def _ids(context: Any) -> tuple[str, int]:
        params = context["params"]
        url = str(params["campaign_url"])
        return (url if "://" in url else os.path.abspath(url)), int(params["block"])

    def _prepare_campaign(self, url: str, overrides: list[str]) -> None:
        from airflow.sdk.exceptions import AirflowFailException

        from milepost.core.recipe_io import load_recipe
        from milepost.tasks.campaign import prepare_campaign

        try:
            prepare_campaign(load_recipe(self.recipe_path, list(overrides)), url)
        except ValueError as e:  # RecipeError: a user mistake, which no retry fixes
            raise AirflowFailException(f"{e}\nTrigger the run again with corrected overrides.") from None

    def execute(self, context: Any) -> dict[str, Any] | None:
        from milepost.core.recipe_io import recipe_from_dict
        from milepost.core.store import CampaignStore

        url, block = self._ids(context)
        store = CampaignStore(url)
        overrides = list(context["params"].get("overrides") or [])
        # The first run writes the campaign; a later one with overrides must match it (else it
        # is refused, saying what changed); a later one without overrides uses what is stored.
        if self.stage == "launch_ray" and (overrides or not store.exists("campaign.yaml")):
            self._prepare_campaign(url, overrides)
        if not store.exists("campaign.yaml"):
            if self.stage == "teardown":
                self.log.info("%s is not a campaign yet (launch_ray did not prepare it): nothing to release", url)
                return None
            raise StageFailedError(f"{url} has no campaign.yaml: launch_ray prepares it; clear that task")
        ids = {"campaign_url": url, "block": block, "stage": self.stage}
        record = store.stage_record(block, self.stage) or {}
        block_done = (store.stage_record(block, "evaluate") or {}).get("state") == "done"
        if self.stage != "teardown" and (record.get("state") == "done" or block_done):
            # A done block is not launched again (its launch_ray/rollout records say `released`).
            self.log.info("block %d %s: %s; keeping the recorded outputs", block, self.stage,
                          "the block is done" if block_done else f"done at {record.get('finished_at')}")
            return {**ids, "job_id": str(record.get("slurm_job_id") or record.get("pid") or "")}

        import yaml
        recipe = recipe_from_dict(yaml.safe_load(store.read_text("campaign.yaml")), "campaign.yaml")
        executor = self._executor(recipe, store)
        submitted_at = time.time()
        job = executor.submit(stage_command(url, block, self.stage), name=f"mp-{self.stage}-b{block}")
        self.log.info("block %d %s: submitted %s job %s (log: %s)", block, self.stage, executor.name, job.job_id,
                      job.stderr_path)
        from milepost.dags.triggers import StageJobTrigger

        self.defer(trigger=StageJobTrigger(url, block, self.stage, executor.name, job.job_id, submitted_at,
                                           pid_created_at=_created_at(job.job_id) if executor.name == "local"
                                           else None, poll_interval_s=self.poll_interval_s),
                   method_name="execute_complete", kwargs={"stderr_path": str(job.stderr_path)})
        return None  # not reached: defer() raises

    @staticmethod
    def _executor(recipe: Any, store: Any) -> Any:
        """Like tasks.block.build_executor, but a local stage must outlive this task process
        (it exits when the task defers): no driver pid is passed to the stage."""
        from pathlib import Path

        os.environ.pop(DRIVER_PID_ENV, None)
        root = Path(store.local_path("jobs"))
        if recipe.cluster.executor == "slurm":
            from milepost.slurm.slurm_executor import SlurmExecutor
            return SlurmExecutor(root, recipe.cluster.slurm.model_copy(update={"nodes": 1}))
        from milepost.slurm.local import LocalExecutor
        return LocalExecutor(root)

    def execute_complete(self, context: Any, event: dict[str, Any], stderr_path: str = "") -> dict[str, Any]:
        if event.get("status") != "done":
            raise StageFailedError(f"block {event.get('block')} stage {event.get('stage')}: {event.get('detail')}; "
                                   f"stage log: {stderr_path or 'see the job folder under <campaign>/jobs'}")
        self.log.info("block %s %s: %s", event["block"], event["stage"], event.get("detail"))
        return {key: event[key] for key in ("campaign_url", "block", "stage", "job_id")}


def _created_at(pid: str) -> float | None:
    import psutil

    try:
        return psutil.Process(int(pid)).create_time()
    except (psutil.NoSuchProcess, ValueError):
        return None
