"""The operator of every block stage: submit `python -m milepost.tasks.stage` for one stage
through the block driver (tasks/block_driver.py: the executor, the stage command, leftover
teardown, timing records, failure messages and the eval report are its policy), then defer
to `StageJobTrigger` until the job ends (no worker slot held meanwhile), then check the outcome.

Stages are idempotent and checkpointed, so an Airflow retry simply submits the stage again:
a stage whose record says `done` is not submitted at all (its recorded outputs stand; the
task succeeds at once), and a partial one resumes from the store. Only identifiers go to
XCom: the campaign URL, the block index, the stage and its job id.

A stage that fails pushes XCom `failure` (`stage`, `error`, `error_kind`: user | runtime, `log`)
before raising, for `block_failed`'s advice. evaluate ends by applying the regression gate
(`tasks.progression.after_evaluate`, idempotent: `progress` reads the same verdict) and logs
the block's summary table (`tasks.block_summary`), so its log shows what the block achieved.

Imports here are Airflow's SDK and the standard library; milepost's recipe schema (pydantic),
the store (fsspec), the block driver and the executors (submitit) are imported inside
`execute`, never when the DAG file is parsed.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

from airflow.sdk import BaseOperator

from milepost.core.records import (
    EMBEDDED_DRIVER_PID_ENV,
    LEASE_OWNER_ENV,
    RECIPE_DOC,
    Stage,
    StageRecord,
    StageState,
    campaign_id,
    parse_stage,
)

if TYPE_CHECKING:
    from milepost.tasks.block_driver import BlockDriver


def embedded_driver_pid() -> int | None:
    """Embedded (dags/embedded.py), the `milepost run` process that local stage jobs die with;
    under a scheduler None: a local stage must outlive this task process, which exits when
    the task defers."""
    return int(os.environ.get(EMBEDDED_DRIVER_PID_ENV) or 0) or None


def embedded() -> bool:
    return embedded_driver_pid() is not None


def lease_owner(context: Any) -> str:
    """Who writes the campaign: the embedded `milepost run`, else this DAG run."""
    return os.environ.get(LEASE_OWNER_ENV) or f"airflow:{context['dag'].dag_id}/{context['run_id']}"


class StageFailedError(RuntimeError):
    """A stage job ended without recording the stage done; the message says where its log is."""


class StageOperator(BaseOperator):
    """One stage of one block. `recipe_path` is the DAG's recipe: start_ray writes the
    campaign (recipe + the run's overrides) to the store on first use, or checks that the
    stored one is the same; the other stages read it from the store."""

    ui_color = "#dbe8f6"

    def __init__(self, *, stage: str, recipe_path: str, poll_interval_s: float = 5.0, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.stage = parse_stage(stage).value  # a plain string: Airflow serializes the operator's fields
        self.recipe_path = recipe_path
        self.poll_interval_s = poll_interval_s

    # --- identifiers from the run's params ----------------------------------------------------
    @staticmethod
    def _ids(context: Any) -> tuple[str, int]:
        params = context["params"]
        return campaign_id(str(params["campaign_url"])), int(params["block"])

    @staticmethod
    def _driver(url: str) -> BlockDriver:
        from milepost.core.store import CampaignStore
        from milepost.tasks.block_driver import BlockDriver

        return BlockDriver(CampaignStore(url), driver_pid=embedded_driver_pid())

    def _prepare_campaign(self, context: Any, url: str, overrides: list[str]) -> None:
        from airflow.sdk.exceptions import AirflowFailException

        from milepost.core.recipe_io import load_recipe
        from milepost.tasks.campaign import prepare_campaign

        try:
            prepare_campaign(load_recipe(self.recipe_path, list(overrides)), url)
        except ValueError as e:  # RecipeError: a user mistake, which no retry fixes
            push_failure(context, self.stage, f"{type(e).__name__}: {e}", "user", None)
            raise AirflowFailException(f"{e}\nTrigger the run again with corrected overrides.") from None

    def _claim(self, context: Any, driver: BlockDriver, block: int) -> str | None:
        """The lease (start_ray takes it, the others renew it), and at start_ray the campaign
        checks: paused or stopped, the right next block, what a killed run left behind. None:
        teardown of a run that never held the lease (another run does; its block is not ours)."""
        import time as _time

        from airflow.sdk.exceptions import AirflowFailException

        from milepost.tasks import lease
        from milepost.tasks.progression import CampaignPaused, check_can_start

        owner, store = lease_owner(context), driver.store
        if self.stage == Stage.TEARDOWN:
            current = lease.read_lease(store)
            if current and current.get("owner") != owner and current.get("expires_at", 0.0) > _time.time():
                self.log.warning("the campaign's lease is held by %s: this run releases nothing of it",
                                 current.get("owner"))
                return None
            return owner
        try:
            if self.stage == Stage.START_RAY:
                lease.acquire(store, owner)
                check_can_start(store, driver.recipe, block, resume=bool(context["params"].get("resume")))
                driver.release_leftovers(block)
            else:
                lease.renew(store, owner)
        except (lease.LeaseHeldError, CampaignPaused) as e:  # no retry changes either
            push_failure(context, self.stage, f"{type(e).__name__}: {e}", "user", None)
            raise AirflowFailException(str(e)) from None
        return owner

    def execute(self, context: Any) -> dict[str, Any] | None:
        url, block = self._ids(context)
        driver = self._driver(url)
        store = driver.store
        overrides = list(context["params"].get("overrides") or [])
        # The first run writes the campaign; a later one with overrides must match it (else it
        # is refused, saying what changed); a later one without overrides uses what is stored.
        if self.stage == Stage.START_RAY and (overrides or not store.is_campaign()):
            self._prepare_campaign(context, url, overrides)
        if not store.is_campaign():
            if self.stage == Stage.TEARDOWN:
                self.log.info("%s is not a campaign yet (start_ray did not prepare it): nothing to release", url)
                return None
            raise StageFailedError(f"{url} has no {RECIPE_DOC}: start_ray prepares it; clear that task")
        ids = {"campaign_url": url, "block": block, "stage": self.stage}
        record = store.stage_record(block, self.stage)
        block_done = store.stage_done(block, Stage.EVALUATE)
        if self.stage != Stage.TEARDOWN and ((record and record.done) or block_done):
            # A done block is not launched again (its start_ray/start_engines records say `released`).
            # A retry of a stage already recorded done (apache/airflow#67287: the executor and the
            # scheduler race and a finished task is put up for retry) ends here, at once.
            self._already_done(driver, block, record, block_done)
            if self.stage == Stage.EVALUATE:
                self._finish_evaluate(driver, block)
            return {**ids, "job_id": str((record and (record.slurm_job_id or record.pid)) or "")}
        owner = self._claim(context, driver, block)  # only a stage that will write needs the lease
        if owner is None:
            return None

        from milepost.dags.triggers import StageJobTrigger
        from milepost.tasks.block_summary import human_time

        submitted = driver.submit(block, parse_stage(self.stage))
        job = submitted.job
        self.log.info("block %d %s: submitted %s job %s at %s; the stage's own output (steps, rewards, "
                      "accuracy, errors) goes to %s", block, self.stage, submitted.executor, job.job_id,
                      human_time(submitted.submitted_at), job.stderr_path)
        self.defer(trigger=StageJobTrigger(url, block, self.stage, submitted.executor, job.job_id,
                                           submitted.submitted_at,
                                           pid_created_at=_created_at(job.job_id) if submitted.executor == "local"
                                           else None, poll_interval_s=self.poll_interval_s,
                                           lease_owner=None if self.stage == Stage.TEARDOWN else owner,
                                           stderr_path=str(job.stderr_path)),
                   method_name="execute_complete")
        return None  # not reached: defer() raises

    def execute_complete(self, context: Any, event: dict[str, Any], stderr_path: str = "") -> dict[str, Any]:
        stderr_path = event.get("stderr_path") or stderr_path
        driver, block = self._driver(event["campaign_url"]), int(event["block"])
        _log_tail(self.log, stderr_path)
        if event.get("status") != "done":
            self._raise_failure(context, driver, event, stderr_path)
        self.log.info("block %s %s: %s (stage log: %s)", block, event["stage"], event.get("detail"), stderr_path)
        if event.get("submitted_at") is not None:
            from milepost.dags.triggers import epoch_of

            driver.record_timing(block, event["stage"], event.get("job_id"), epoch_of(event["submitted_at"]),
                                 stderr_path, event.get("executor"))
        if self.stage == Stage.EVALUATE:
            self._finish_evaluate(driver, block)
        if self.stage == Stage.TEARDOWN and not embedded():
            from milepost.tasks import lease

            # The run is over once the allocation is released: the next block's run takes the lease.
            lease.release(driver.store, lease_owner(context))
        return {key: event[key] for key in ("campaign_url", "block", "stage", "job_id")}

    def _already_done(self, driver: BlockDriver, block: int, record: StageRecord | None, block_done: bool) -> None:
        """Say what the earlier try did, in words and local times, and make sure timings.json
        has it (the first try may have ended before it could write it)."""
        from milepost.tasks.block_summary import human_duration, human_time

        if record is None or not record.done:  # only the block is done (its evaluate)
            self.log.info("block %d %s: the block is done; keeping the recorded outputs", block, self.stage)
            return
        started, finished = float(record.started_at or 0.0), float(record.finished_at or 0.0)
        timing = driver.timing_of_done_stage(block, parse_stage(self.stage), record)
        job = f"Slurm job {record.slurm_job_id}" if record.slurm_job_id else f"pid {record.pid}"
        log_path = timing.get("log") or record.log
        self.log.info("block %d %s: already done by an earlier try: ran %s → %s (%s) as %s; its log: %s. "
                      "Keeping its outputs (a retry of a finished stage ends at once).", block, self.stage,
                      human_time(started), human_time(finished), human_duration(finished - started), job,
                      log_path or "not recorded")
        if log_path:
            _log_tail(self.log, log_path)

    def _finish_evaluate(self, driver: BlockDriver, block: int) -> None:
        """The regression gate's verdict, the block's report, and its summary table at the end
        of this task's log."""
        decision, table = driver.finish_evaluate(block)
        self.log.info("block %d: %s\n%s", block, decision.message, table)

    def _raise_failure(self, context: Any, driver: BlockDriver, event: dict[str, Any], stderr_path: str) -> None:
        """The stage's root error first (from its record), then the job's state and its log.
        A user error (recorded `error_kind: user`) fails the task for good: no retry fixes it."""
        from airflow.sdk.exceptions import AirflowFailException

        failure = driver.failure(int(event["block"]), self.stage, event.get("detail", ""), stderr_path)
        self.log.error("%s", failure)
        record = driver.store.stage_record(int(event["block"]), self.stage)
        failed = record is not None and record.state is StageState.FAILED
        push_failure(context, self.stage, (record.error if failed else None) or event.get("detail", ""),
                     "user" if failure.user_error else "runtime", (record.log if record else None) or stderr_path)
        if failure.user_error:
            raise AirflowFailException(f"{failure}\nThis is an input error, not retried: fix it and run again.")
        raise StageFailedError(str(failure))


def push_failure(context: Any, stage: str, error: str, error_kind: str, log_path: str | None) -> None:
    """XCom `failure` of the failing task, read by `block_failed` (pushed before raising)."""
    ti = context.get("ti")
    if ti is None:  # the operator called outside a task run (unit tests): nobody to tell
        return
    ti.xcom_push(key="failure", value={"stage": stage, "error": error, "error_kind": error_kind, "log": log_path})


def _log_tail(log: Any, path: str, num_lines: int = 15) -> None:
    """The end of the stage job's own log, so the task log shows what the stage said last."""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 16384))
            lines = f.read().decode(errors="replace").splitlines()[-num_lines:]
    except OSError:
        return
    if lines:
        log.info("last lines of the stage's log %s:\n%s", path, "\n".join(f"  | {line}" for line in lines))


def _created_at(pid: str) -> float | None:
    import psutil

    try:
        return psutil.Process(int(pid)).create_time()
    except (psutil.NoSuchProcess, ValueError):
        return None
