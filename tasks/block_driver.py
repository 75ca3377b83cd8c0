"""The one block driver: the policy every way of running a block shares.

    start_ray → start_engines → run_steps → publish → evaluate, then teardown whatever happened

Three callers run blocks through it: the DAG's stage operator (dags/operators.py: one stage
per task, submit here → defer to the trigger there → `finish_stage` here), the embedded
runner of `milepost run` (dags/embedded.py: the same DAG through `dag.test()`, block
retries here), and synchronous drivers without Airflow (`run_block`: tests, bench/gpu_loop.py,
bench/stage_jobs.py). What they share lives here, once:

- the executor (`cluster.executor`) and the stage job's command. A local stage job is told
  on its command line which process it dies with (`--driver-pid`); nothing is passed
  through this process's environment. Slurm stage jobs outlive their driver by design.
- the release of what a killed run left (a launched block whose teardown never ran),
- block retries (`retry_block`: a user error is never retried),
- timing records (blocks/N/timings.json: per stage, submitted → started → finished → seen),
- the failure message of a stage (its recorded root error first, then its job's end),
- the eval report (the regression gate, the block's report and summary table, the
  held-out accuracy line).

Every stage is its own job submitted through the executor interface (`slurm/executor.py`)
running `python -m milepost.tasks.stage`; stages share nothing in memory, only the store.
On Slurm each stage is a one-node sbatch job (`mp-<stage>-b<N>`) that joins the allocation's
Ray head by its recorded address; the allocation itself is `mp-ray-b<N>`. Why not `srun
--overlap` steps of the allocation: start_ray cannot be a step of the allocation it creates,
teardown must run while (and after) the allocation is cancelled, and a step cannot be
requeued on its own.
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING, Any

from milepost.core.config import Recipe
from milepost.core.records import (
    BLOCK_STAGES,
    TIMINGS_DOC,
    Stage,
    StageRecord,
    StageState,
    block_path,
    campaign_id,
    parse_stage,
)
from milepost.core.store import CampaignStore
from milepost.slurm.executor import Executor, JobHandle
from milepost.tasks.failures import is_user_error, stage_failure

if TYPE_CHECKING:
    from milepost.tasks.progression import Decision

log = logging.getLogger(__name__)


class StageFailed(RuntimeError):
    """A stage job ended without recording its stage done; the message names the root error
    and the stage's log."""

    def __init__(self, message: str, user_error: bool = False) -> None:
        super().__init__(message)
        self.user_error = user_error  # the user's input is wrong: relaunching cannot help


@dataclass(frozen=True)
class SubmittedStage:
    block: int
    stage: Stage
    job: JobHandle
    submitted_at: float
    executor: str


def stage_command(url: str, block: int, stage: Stage | str, driver_pid: int | None = None) -> list[str]:
    """The stage job's command; with `driver_pid`, the job exits once that process is gone."""
    command = [sys.executable, "-m", "milepost.tasks.stage", "--campaign", url, "--block", str(block),
               "--stage", parse_stage(stage).value]
    return command + (["--driver-pid", str(driver_pid)] if driver_pid else [])


def build_executor(recipe: Recipe, store: CampaignStore) -> Executor:
    """The executor of the recipe's `cluster` section; job folders go under <campaign>/jobs."""
    root = Path(store.local_path("jobs"))
    if recipe.cluster.executor == "slurm":
        from milepost.slurm.slurm_executor import SlurmExecutor
        # Stage jobs are one-node jobs; only the Ray allocation spans `cluster.num_nodes`.
        return SlurmExecutor(root, recipe.cluster.slurm.model_copy(update={"nodes": 1}))
    from milepost.slurm.local import LocalExecutor
    return LocalExecutor(root)


def retry_block(block: int, max_retries: int, attempt: Callable[[], StageFailed | None],
                say: Callable[[str], None]) -> StageFailed | None:
    """Run `attempt` (one launch of the block, torn down after) until it succeeds, fails on
    the user's input, or was retried `max_retries` times; the last failure, or None. A retry
    launches the block afresh and run_steps resumes from its last checkpoint (a lost node, a
    cancelled allocation)."""
    for number in range(max_retries + 1):
        failure = attempt()
        if failure is None or failure.user_error or number == max_retries:
            return failure
        say(f"tearing block {block} down and launching it again ({number + 1}/{max_retries})")
    return None  # not reached: the last attempt returns


def eval_line(store: CampaignStore, recipe: Recipe, block: int) -> str:
    """`block 1 (last: 3): held-out accuracy 0.412 (base policy 0.250, +0.162)`."""
    accuracy = (store.block_eval(block) or {})["accuracy"]
    base = store.read_json("base_eval.json")["accuracy"] if store.exists("base_eval.json") else None
    versus = f" (base policy {base:.3f}, {accuracy - base:+.3f})" if base is not None else ""
    return f"block {block} (last: {recipe.campaign.num_blocks - 1}): held-out accuracy {accuracy:.3f}{versus}"


class BlockDriver:
    """The blocks of one campaign. `driver_pid`: the process local stage jobs die with (None:
    they outlive whoever submitted them, as under an Airflow scheduler)."""

    def __init__(self, store: CampaignStore, recipe: Recipe | None = None, driver_pid: int | None = None) -> None:
        self.store, self.url, self.driver_pid = store, campaign_id(store.url), driver_pid
        self._recipe = recipe

    @property
    def recipe(self) -> Recipe:
        """The campaign's recipe, read from the store when first needed (a failed stage's
        message and its timing do not need it)."""
        if self._recipe is None:
            self._recipe = self.store.load_recipe()
        return self._recipe

    @cached_property
    def executor(self) -> Executor:
        # Built on first use: it makes a job folder, which a stage already done never needs.
        return build_executor(self.recipe, self.store)

    # --- one stage ------------------------------------------------------------------------
    def submit(self, block: int, stage: Stage) -> SubmittedStage:
        local = self.recipe.cluster.executor == "local"
        command = stage_command(self.url, block, stage, self.driver_pid if local else None)
        submitted_at = time.time()
        job = self.executor.submit(command, name=f"mp-{stage}-b{block}")
        return SubmittedStage(block, stage, job, submitted_at, self.executor.name)

    def wait(self, submitted: SubmittedStage, watch: Callable[[SubmittedStage], None] | None = None) -> None:
        """Wait for a stage job; raises StageFailed when it did not record its stage done.
        `watch` runs while the job runs (bench/stage_jobs.py's kill plan) and returns when it ends."""
        from milepost.slurm.executor import JobError

        try:
            if watch is not None:
                watch(submitted)
            submitted.job.result()
        except JobError as e:
            raise self.failure(submitted.block, submitted.stage, str(e), str(submitted.job.stderr_path)) from e
        finally:
            self.record_timing(submitted.block, submitted.stage, submitted.job.job_id, submitted.submitted_at,
                               str(submitted.job.stderr_path), submitted.executor)

    def run_stage(self, block: int, stage: Stage, watch: Callable[[SubmittedStage], None] | None = None) -> None:
        """Submit one stage job and wait for it (see `wait`)."""
        submitted = self.submit(block, stage)
        log.info("block %d: %s submitted (%s job %s)", block, stage, submitted.executor, submitted.job.job_id)
        self.wait(submitted, watch)
        log.info("block %d: %s done in %.1fs", block, stage, time.time() - submitted.submitted_at)

    def failure(self, block: int, stage: Stage | str, job_detail: str, stderr_path: str = "") -> StageFailed:
        """The stage's root error (from its record) first, then its job's end, and its log."""
        record = self.store.stage_record(block, stage)
        return StageFailed(f"block {block} stage {parse_stage(stage)} failed: "
                           f"{stage_failure(record, job_detail, stderr_path)}", user_error=is_user_error(record))

    # --- timing records -------------------------------------------------------------------
    def record_timing(self, block: int, stage: Stage | str, job_id: str | int | None, submitted_at: float,
                      log_path: str | None, executor: str | None = None, **extra: Any) -> dict[str, Any]:
        """blocks/N/timings.json's entry of a stage: when it was submitted, ran and was seen
        done (the orchestration overhead is what lies between)."""
        stage = parse_stage(stage)  # an older trigger's event may carry an old name
        record = self.store.stage_record(block, stage)
        rel = block_path(block, TIMINGS_DOC)
        timings = self.store.read_json(rel) if self.store.exists(rel) else {"executor": executor, "stages": {}}
        entry = {"job_id": job_id, "submitted_at": submitted_at,
                 "started_at": (record and record.started_at) or 0.0,
                 "finished_at": (record and record.finished_at) or 0.0,
                 "returned_at": time.time(), "log": log_path or None, **extra}
        timings["stages"][stage.value] = entry
        self.store.write_json(rel, timings)
        return entry

    def timing_of_done_stage(self, block: int, stage: Stage, record: StageRecord) -> dict[str, Any]:
        """timings.json's entry of a stage recorded done; written from its record when its try
        ended before writing it (the submission time is not known: its start stands in)."""
        rel = block_path(block, TIMINGS_DOC)
        entry = (self.store.read_json(rel) if self.store.exists(rel) else {}).get("stages", {}).get(stage.value)
        if entry is not None:
            return entry
        return self.record_timing(block, stage, record.slurm_job_id or record.pid, record.started_at or 0.0,
                                  record.log, from_record=True)

    # --- the block ------------------------------------------------------------------------
    def release_leftovers(self, block: int) -> bool:
        """A block that a killed run left launched (start_ray not `released`, its teardown never
        ran) is torn down first, so this run does not attach to a dead Ray cluster; run_steps
        then resumes from its checkpoint and done stages keep their records."""
        launch = self.store.stage_record(block, Stage.START_RAY)
        if launch is None or launch.state is StageState.RELEASED or self.store.stage_done(block, Stage.EVALUATE):
            return False
        from milepost.tasks.stage import run_stage

        log.info("block %d: releasing what an earlier run left (start_ray %s)", block, launch.state)
        run_stage(self.url, block, Stage.TEARDOWN)
        return True

    def teardown(self, block: int) -> None:
        """The teardown stage as a job; in this process if that job could not run (the
        allocation must be released whatever happened)."""
        try:
            self.run_stage(block, Stage.TEARDOWN)
        except Exception as e:  # noqa: BLE001 - fall back, then report
            from milepost.tasks.stage import run_stage

            log.warning("block %d: teardown job failed (%s); tearing down from this process", block, e)
            run_stage(self.url, block, Stage.TEARDOWN)

    def run_block(self, block: int, watch: Callable[[SubmittedStage], None] | None = None) -> None:
        """Every stage of the block as a job, in order, teardown after each launch, the block
        launched again on a runtime failure (`cluster.max_block_retries`); raises StageFailed."""
        if self.store.stage_done(block, Stage.EVALUATE):
            log.info("block %d already done", block)
            return
        self.release_leftovers(block)
        failure = retry_block(block, self.recipe.cluster.max_block_retries, lambda: self._launch(block, watch),
                              log.warning)
        if failure is not None:
            raise failure
        decision, _ = self.finish_evaluate(block)
        log.info("%s; %s", eval_line(self.store, self.recipe, block), decision.message)

    def _launch(self, block: int, watch: Callable[[SubmittedStage], None] | None) -> StageFailed | None:
        try:
            for stage in BLOCK_STAGES:
                self.run_stage(block, stage, watch)
        except StageFailed as failure:
            log.warning("%s", failure)
            return failure
        finally:
            self.teardown(block)
        return None

    def finish_evaluate(self, block: int, rewrite: bool = True) -> tuple[Decision, str]:
        """The regression gate's verdict (idempotent: each caller acts on the same one), the
        block's report (plot, report.html, summary.md; kept as it is unless `rewrite`), and its
        summary table."""
        from milepost.tasks.block_summary import SUMMARY_MD, format_summary, read_block_summary, write_block_report
        from milepost.tasks.progression import after_evaluate

        decision = after_evaluate(self.store, self.recipe, block)
        kept = not rewrite and self.store.exists(block_path(block, SUMMARY_MD))
        summary = read_block_summary(self.store, block) if kept else write_block_report(self.store, block)
        return decision, format_summary(summary)
