"""One block: start_ray → start_engines → run_steps → publish → evaluate, then teardown
whatever happened.

Every stage is its own job submitted through the executor interface (`cluster.executor`:
local processes, or Slurm jobs) running `milepost.tasks.stage.run_stage`; this driver only
submits, waits and reports. Stages share nothing in memory: they read and write the store.

On Slurm, each stage is a small one-node sbatch job (submitit, job name `mp-<stage>-b<N>`)
that joins the allocation's Ray head by its recorded address; the allocation itself is the
job `mp-ray-b<N>`. Why not `srun --jobid=<allocation> --overlap` steps: start_ray cannot
be a step of the allocation it creates, teardown must run while (and after) the allocation
is cancelled, and a step cannot be requeued on its own. Separate jobs go through the one
executor interface, are requeued by Slurm on a node failure, and appear in `sacct` by name.
On the dev cluster they fit beside the allocation (each node has 2 CPUs; the allocation
holds 1 per node).

A block left unfinished by a killed `milepost run` (its start_ray record not `released`)
is torn down first from its records (the old Ray cluster, the old fleet, stage jobs still
running), then launched again: run_steps resumes from the last committed checkpoint, and
done run_steps/publish/evaluate records are kept.
"""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path
from typing import Any

from milepost.core.config import Recipe
from milepost.core.records import (
    BLOCK_STAGES,
    DRIVER_PID_ENV,
    TIMINGS_DOC,
    Stage,
    StageState,
    block_path,
    campaign_id,
)
from milepost.core.store import CampaignStore
from milepost.tasks.failures import is_user_error, stage_failure
from milepost.tasks.stage import run_stage

log = logging.getLogger(__name__)


def build_executor(recipe: Recipe, store: CampaignStore) -> Any:
    """The executor of the recipe's `cluster` section; job folders go under <campaign>/jobs."""
    root = Path(store.local_path("jobs"))
    if recipe.cluster.executor == "slurm":
        from milepost.slurm.slurm_executor import SlurmExecutor
        os.environ.pop(DRIVER_PID_ENV, None)  # Slurm stage jobs outlive the driver by design
        # Stage jobs are one-node jobs; only the Ray allocation spans `cluster.num_nodes`.
        return SlurmExecutor(root, recipe.cluster.slurm.model_copy(update={"nodes": 1}))
    from milepost.slurm.local import LocalExecutor
    # Local stage jobs die with this process (see stage._die_with_driver).
    os.environ[DRIVER_PID_ENV] = str(os.getpid())
    return LocalExecutor(root)


class StageFailed(RuntimeError):
    def __init__(self, message: str, user_error: bool = False) -> None:
        super().__init__(message)
        self.user_error = user_error  # the user's input is wrong: relaunching cannot help


class BlockRunner:
    def __init__(self, recipe: Recipe, store: CampaignStore, show_progress: bool = True) -> None:
        self.recipe, self.store, self.show_progress = recipe, store, show_progress
        self.url = campaign_id(store.url)
        self.executor = build_executor(recipe, store)

    # --- the block ------------------------------------------------------------------------
    def run_block(self, block: int) -> None:
        if self.store.stage_done(block, Stage.EVALUATE):
            log.info("block %d already done", block)
            return
        launch = self.store.stage_record(block, Stage.START_RAY)
        if launch and launch.state is not StageState.RELEASED:
            log.info("block %d: releasing what a previous run left (%s)", block, launch.outputs.get("mode"))
            self.teardown(block)
        retries = self.recipe.cluster.max_block_retries
        for attempt in range(retries + 1):
            try:
                self._run_stages(block)
                break
            except StageFailed as e:
                if attempt == retries or e.user_error:
                    raise
                log.warning("block %d: %s; tearing the block down and launching it again (%d/%d)",
                            block, e, attempt + 1, retries)
            finally:
                self.teardown(block)
        self._report_eval(block)

    def _run_stages(self, block: int) -> None:
        timings: dict[str, Any] = {"executor": self.executor.name, "stages": {}}
        for stage in BLOCK_STAGES:
            timings["stages"][stage.value] = self._run(block, stage)
            self.store.write_json(block_path(block, TIMINGS_DOC), timings)

    def _run(self, block: int, stage: Stage) -> dict[str, float]:
        """Submit one stage job and wait for it; its driver-side timings."""
        from milepost.slurm.executor import JobError

        submitted = time.time()
        job = self.executor.submit(run_stage, self.url, block, stage, name=f"mp-{stage}-b{block}")
        log.info("block %d: %s submitted (%s job %s)", block, stage, self.executor.name, job.job_id)
        try:
            if stage is Stage.RUN_STEPS and self.show_progress:
                self._show_progress(block, job)
            record = job.result()
        except JobError as e:
            record = self.store.stage_record(block, stage)
            raise StageFailed(f"block {block} stage {stage} failed ({self.executor.name} job {job.job_id}): "
                              f"{stage_failure(record, str(e), str(job.stderr_path))}",
                              user_error=is_user_error(record)) from e
        returned = time.time()
        log.info("block %d: %s done in %.1fs", block, stage, returned - submitted)
        return {"job_id": job.job_id, "submitted_at": submitted, "started_at": record.started_at or 0.0,
                "finished_at": record.finished_at or 0.0, "returned_at": returned}

    def _show_progress(self, block: int, job: Any) -> None:
        """A progress bar of the run_steps stage job, read from the block's metrics file."""
        from tqdm import tqdm

        first = block * self.recipe.campaign.steps_per_block
        with tqdm(total=self.recipe.campaign.steps_per_block, desc=f"block {block}") as bar:
            while not job.state().outcome.terminal:
                rows = self.store.read_metrics(block)
                bar.n = max(0, (rows[-1]["step"] - first) if rows else 0)
                if rows:
                    bar.set_postfix(reward=f"{rows[-1].get('rollout/reward_mean', float('nan')):.3f}")
                bar.refresh()
                time.sleep(1.0)

    def teardown(self, block: int) -> None:
        """The teardown stage as a job; in this process if that job could not run (the
        allocation must be released whatever happened)."""
        try:
            self._run(block, Stage.TEARDOWN)
        except Exception as e:  # noqa: BLE001 - fall back, then report
            log.warning("block %d: teardown job failed (%s); tearing down from this process", block, e)
            run_stage(self.url, block, Stage.TEARDOWN)

    def _report_eval(self, block: int) -> None:
        accuracy = (self.store.block_eval(block) or {})["accuracy"]
        base = self.store.read_json("base_eval.json")["accuracy"] if self.store.exists("base_eval.json") else None
        versus = f" (base policy {base:.3f}, {accuracy - base:+.3f})" if base is not None else ""
        log.info("block %d (last: %d): held-out accuracy %.3f%s", block, self.recipe.campaign.num_blocks - 1,
                 accuracy, versus)


def stage_summary(store: CampaignStore, block: int) -> str:
    """The block's driver-side timings, as JSON (for tools and benchmarks)."""
    rel = block_path(block, TIMINGS_DOC)
    return json.dumps(store.read_json(rel) if store.exists(rel) else {}, indent=2)
