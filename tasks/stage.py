"""One block stage, run as its own job: `python -m milepost.tasks.stage --campaign URL --block N
--stage NAME [--driver-pid PID]`, submitted by the block driver (tasks/block_driver.py); or
`run_stage(url, block, name)` in-process (a teardown that could not run as a job).

The stage reads the recipe from the campaign store (campaign.yaml), runs exactly one stage
and writes its record. Idempotent: a `done` record is returned as it is; otherwise the
stage runs (a partial one resumes from the store) and its record is written. Stages talk to
each other ONLY through store records: the Ray address (start_ray), the fleet's actor
names and URLs (blocks/N/fleet.json), checkpoints. `teardown` always runs: it releases
whatever the block's records say it owns. The stages and their records: core/records.py.

While it runs, the record says `running` with this process's pid (and Slurm job id): a
later `milepost run` stops a stage left over from a killed run by that record, never by name.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import psutil

from milepost.core.records import Stage, StageRecord, StageState, parse_stage
from milepost.core.store import CampaignStore
from milepost.tasks.context import StageContext
from milepost.tasks.ray_auth import campaign_ray_auth

log = logging.getLogger(__name__)

USER_ERROR_EXIT = 2  # a stage job that exits 2 failed on the user's input: retrying cannot help


def _now() -> float:
    return round(time.time(), 3)


def _stage_fn(stage: Stage) -> Callable[[StageContext], dict[str, Any]]:
    # Imported on demand: start_ray and teardown need neither torch nor the engines.
    if stage in (Stage.START_RAY, Stage.TEARDOWN):
        from milepost.tasks import ray_cluster
        return {Stage.START_RAY: ray_cluster.start_ray, Stage.TEARDOWN: ray_cluster.teardown}[stage]
    if stage is Stage.RUN_STEPS:
        from milepost.tasks.run_steps import run_steps
        return run_steps
    from milepost.tasks import fleet_stages
    return {Stage.START_ENGINES: fleet_stages.start_engines, Stage.PUBLISH: fleet_stages.publish,
            Stage.EVALUATE: fleet_stages.evaluate}[stage]


def die_with(driver_pid: int | None) -> None:
    """A local stage job must not outlive the `milepost run` (or other driver) that started
    it: a SIGKILLed driver runs no clean-up, and its rerun would race the orphan. Its pid
    comes on the command line (`--driver-pid`); a daemon thread exits this process once it
    is gone."""
    if not driver_pid:
        return

    def watch() -> None:
        while psutil.pid_exists(driver_pid) and psutil.Process(driver_pid).status() != psutil.STATUS_ZOMBIE:
            time.sleep(0.2)
        os._exit(137)

    threading.Thread(target=watch, daemon=True, name="die-with-driver").start()


def running_record() -> StageRecord:
    me = psutil.Process()
    # `log`: where this job's output goes, kept in the done record too: a task retried after the
    # stage finished (its first try's log hidden by Airflow) can still point to it.
    return StageRecord(StageState.RUNNING, started_at=_now(), pid=me.pid, pid_created_at=me.create_time(),
                       host=socket.gethostname(), slurm_job_id=os.environ.get("SLURM_JOB_ID"), log=own_log_path())


def run_stage(campaign_url: str, block: int, stage: Stage | str) -> StageRecord:
    """Run one stage of one block (idempotent); returns its record."""
    stage = parse_stage(stage)
    ctx = StageContext.open(campaign_url, block)
    with campaign_ray_auth(ctx.store):  # the head this stage starts, or the one it joins
        return _run_stage_in(ctx, block, stage)


def _run_stage_in(ctx: StageContext, block: int, stage: Stage) -> StageRecord:
    if ctx.recipe.cluster.executor == "slurm" and os.environ.get("SLURM_JOB_ID"):
        _outlive_slurm_term()
    record = ctx.store.stage_record(block, stage)
    if record and record.done and stage is not Stage.TEARDOWN:
        return record
    started = running_record()
    ctx.store.write_stage_record(block, stage, started)
    try:
        outputs = _stage_fn(stage)(ctx)
    except Exception as error:
        record_failure(ctx.store, block, stage, error)
        raise
    finally:
        ctx.disconnect()
    # Fields the stage recorded while running (pids, first step time) are kept.
    record = (ctx.store.stage_record(block, stage) or started).merged(state=StageState.DONE, finished_at=_now(),
                                                                      **outputs)
    ctx.store.write_stage_record(block, stage, record)
    return record


def own_log_path() -> str | None:
    """This stage job's stderr file, when it runs under an executor (submitit sets its folder)."""
    try:
        import submitit
        return str(submitit.JobEnvironment().paths.stderr)
    except Exception:  # noqa: BLE001 - run by hand, outside any executor: no job log
        return None


def record_failure(store: CampaignStore, block: int, stage: Stage, error: BaseException) -> None:
    """The stage's record says `failed`, with the root error on one line, whether it was the
    user's (deterministic: not retried) or the runtime's, and where the whole log is. That is
    what `milepost run`, `milepost status` and the Airflow task log show."""
    from milepost.core.errors import root_error_line, user_error_in

    record = store.stage_record(block, stage) or StageRecord(StageState.FAILED)
    store.write_stage_record(block, stage, record.merged(
        state=StageState.FAILED, failed_at=_now(), error=root_error_line(error),
        error_kind="user" if user_error_in(error) else "runtime", log=own_log_path()))


def _outlive_slurm_term() -> None:
    """Under Slurm, SIGTERM reaches every process of the job step: it announces preemption
    (the job's submitit process then requeues it on USR2), a cancel or the time limit, and
    each ends in SIGKILL after KillWait. Dying at TERM would fail the job before submitit
    can requeue it, so the stage keeps working until it is killed; its checkpoints make
    that safe, and the requeued job resumes from them."""
    def note(signum: int, frame: Any) -> None:
        log.warning("SIGTERM from Slurm (preemption, cancel or time limit): working on until stopped")
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, note)


def _stage_arg(name: str) -> Stage:
    try:
        return parse_stage(name)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Run one block stage of a campaign (idempotent).")
    parser.add_argument("--campaign", required=True, help="campaign store URL or folder")
    parser.add_argument("--block", type=int, required=True)
    parser.add_argument("--stage", required=True, type=_stage_arg, metavar="|".join(Stage),
                        help="the stage (names from before the rename are read as the new ones)")
    parser.add_argument("--driver-pid", type=int, default=None,
                        help="exit once this process is gone (a local stage job of `milepost run`)")
    args = parser.parse_args(argv)
    die_with(args.driver_pid)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    # The job's log is what a user reads: one line per engine request would bury the steps.
    logging.getLogger("httpx").setLevel(logging.WARNING)
    from milepost.core.errors import user_error_in

    try:
        record = run_stage(args.campaign, args.block, args.stage)
    except Exception as e:
        user_error = user_error_in(e)
        if user_error is None:
            raise  # a runtime failure: its traceback belongs in the stage log
        # The user's mistake: its message, no traceback, and no retry.
        print(f"milepost: block {args.block} stage {args.stage}: {user_error}", file=sys.stderr)
        return USER_ERROR_EXIT
    from milepost.tasks.block_summary import stage_done_line

    log.info("%s", stage_done_line(args.block, args.stage, record))  # into the job's log, which tasks point to
    print(json.dumps(record.to_dict(), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
