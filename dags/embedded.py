"""The embedded runner of `milepost run`: the very DAG a scheduler runs (one run = one block)
through `dag.test()`, in a child process of `milepost run` (`python -m milepost.dags.embedded
--campaign URL --dag-id ID --driver-pid PID`, started by milepost/run_cmd.py), so that
Airflow's import, logging set-up and database stay out of the CLI process. Its AIRFLOW_HOME is
`<campaign>/airflow/` (SQLite, migrated on first use); see dags/airflow_home.py.

Each block's DAG run logs to `<campaign>/airflow/logs/block_<NNNNNN>.log` (every task's log,
in order, as the Airflow UI would show them one by one). A failed run is launched again as
the block driver's retry policy says (tasks/block_driver.retry_block: a user error never);
between blocks the runner applies the same progression decision as the DAG's `progress`
task (`tasks.progression.after_evaluate`, idempotent) and stops on `done`, `paused` or
`stopped`. The runner dies with `milepost run`, and so do its local stage jobs.
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
import time
from pathlib import Path
from typing import Any

from milepost.core.records import Stage, StageRecord, block_path
from milepost.core.store import CampaignStore
from milepost.dags.airflow_home import (
    EXIT_DONE,
    EXIT_FAILED,
    EXIT_PAUSED,
    EXIT_REFUSED,
    block_log,
    dags_folder,
    embedded_home,
)
from milepost.tasks.block_driver import StageFailed, retry_block
from milepost.tasks.failures import block_failure, is_user_error, stage_failure


def ensure_migrated(home: Path) -> None:
    """`airflow db migrate` on first use (≈ 5-11 s), skipped once this Airflow version did it."""
    import airflow
    from airflow.utils import db

    marker = home / f".migrated-{airflow.__version__}"
    if not marker.exists():
        db.upgradedb()
        marker.write_text(time.strftime("%Y-%m-%dT%H:%M:%S"))


class _BlockLog:
    """fds 1 and 2 pointed at one block's log while its DAG run runs (Airflow's task logs go
    to stdout under dag.test); `user` stays the terminal of `milepost run`."""

    def __init__(self) -> None:
        self.user = os.fdopen(os.dup(2), "w", buffering=1)
        self._saved = (os.dup(1), os.dup(2))

    def to(self, path: Path) -> None:
        sys.stdout.flush()
        sys.stderr.flush()
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.close(fd)

    def back(self) -> None:
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(self._saved[0], 1)
        os.dup2(self._saved[1], 2)


class EmbeddedRunner:
    """One `dag.test()` per block until the campaign is done, paused, stopped or a block failed."""

    def __init__(self, url: str, dag_id: str, dag: Any, logs: _BlockLog) -> None:
        self.store, self.url, self.dag_id, self.dag, self.logs = CampaignStore(url), url, dag_id, dag, logs
        self.recipe = self.store.load_recipe()

    def run_blocks(self, block: int | None) -> int:
        from milepost.tasks.progression import after_evaluate

        while block is not None:
            run = functools.partial(self.run_block, block)
            failure = retry_block(block, self.recipe.cluster.max_block_retries, run,
                                  lambda line: self.logs.user.write(f"milepost: {line}\n"))
            if failure is not None:
                return EXIT_REFUSED if failure.user_error else EXIT_FAILED
            decision = after_evaluate(self.store, self.recipe, block)
            if decision.action != "next":
                self.logs.user.write(f"milepost: {decision.message}\n")
                return EXIT_DONE if decision.action == "done" else EXIT_PAUSED
            block = decision.next_block
        return EXIT_DONE

    def run_block(self, block: int) -> StageFailed | None:
        """One DAG run of the block; its teardown task released the block whatever happened."""
        self.logs.to(block_log(self.store, block))
        started = time.time()
        run = self.dag.test(run_conf={"campaign_url": self.url, "block": block, "overrides": [], "resume": False},
                            logical_date=None)
        state = str(getattr(run.state, "value", run.state))
        self.store.write_json(block_path(block, "dag_run.json"), {
            "mode": "embedded", "dag_id": self.dag_id, "run_id": run.run_id, "state": state,
            "started_at": started, "ended_at": time.time()})
        failed = block_failure(lambda stage: self.store.stage_record(block, stage), since=started)
        self._note_run(block, run.run_id, state, failed)
        if state == "success":
            return None
        message = _failure_message(self.store, block, state, failed)
        self.logs.user.write(message)
        return StageFailed(message.strip(), user_error=bool(failed and is_user_error(failed[1])))

    def _note_run(self, block: int, run_id: str, state: str, failed: tuple[Stage, StageRecord] | None) -> None:
        """The run's note, as a scheduler's run gets it from its tasks (dags/progress.py,
        dags/block_failed.py): under dag.test() there is no API server, so the runner writes it
        into the run's database (the embedded Airflow's UI shows it when pointed at that home)."""
        from milepost.tasks.block_summary import failure_note, format_summary, read_block_summary

        if state == "success":
            note = format_summary(read_block_summary(self.store, block))
        elif failed:
            stage, record = failed
            note = failure_note(block, stage, record.error or "no error recorded", record.error_kind, record.log)
        else:
            note = failure_note(block, None, f"the run ended {state}; its task log says why", None,
                                str(block_log(self.store, block)))
        try:
            set_note_in_db(self.dag_id, run_id, note)
        except Exception as e:  # noqa: BLE001 - a note is a convenience: say why it is missing, go on
            self.logs.user.write(f"milepost: block {block}'s DAG run note was not set ({type(e).__name__}: {e})\n")


def set_note_in_db(dag_id: str, run_id: str, note: str) -> None:
    """The embedded case (dag.test(), no API server): write the note in the run's database as
    Airflow's own PATCH handler does (a new note, or the existing note's text replaced).
    A scheduler's runs get theirs through the REST API instead (dags/run_note.py)."""
    from airflow.models.dagrun import DagRun
    from airflow.utils.session import create_session
    from sqlalchemy import select

    with create_session() as session:
        run = session.scalar(select(DagRun).where(DagRun.dag_id == dag_id, DagRun.run_id == run_id))
        if run is None:
            raise LookupError(f"no DAG run {dag_id}/{run_id} in this Airflow's database")
        if run.dag_run_note is None:
            run.note = (note[:1000], None)
        else:
            run.dag_run_note.content = note[:1000]


def _failure_message(store: CampaignStore, block: int, state: str,
                     failed: tuple[Stage, StageRecord] | None) -> str:
    """What the user reads first: the failed stage and its root error, then where to look."""
    head = f"milepost: block {block}'s DAG run {state}"
    if failed is None:  # killed from outside: nothing recorded, the task log says what Airflow saw
        return f"{head}; its task log: {block_log(store, block)}\n"
    stage, record = failed
    kind = "input error, not retried" if is_user_error(record) else "runtime error"
    return (f"{head}: stage {stage} failed ({kind}): {stage_failure(record, '')}\n"
            f"milepost: the block's task log: {block_log(store, block)}\n")


def run_embedded(url: str, dag_id: str, driver_pid: int | None) -> int:
    """The runner's process: the DAG loaded from the project's dags folder, then its blocks."""
    from milepost.tasks.progression import next_block
    from milepost.tasks.stage import die_with

    die_with(driver_pid)
    store = CampaignStore(url)
    block = next_block(store, store.load_recipe())
    if block is None:
        return EXIT_DONE
    logs = _BlockLog()
    logs.to(block_log(store, block))  # Airflow's start-up output goes to the first block's log
    try:
        ensure_migrated(embedded_home(store))
        from airflow.dag_processing.dagbag import DagBag

        bag = DagBag(dag_folder=str(dags_folder()))
        if bag.import_errors or dag_id not in bag.dags:
            logs.user.write(f"milepost: the campaign's DAG {dag_id} did not load: {bag.import_errors}\n")
            return EXIT_FAILED
        return EmbeddedRunner(url, dag_id, bag.dags[dag_id], logs).run_blocks(block)
    finally:
        logs.back()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="milepost's embedded Airflow (started by `milepost run`)")
    parser.add_argument("--campaign", required=True)
    parser.add_argument("--dag-id", required=True)
    parser.add_argument("--driver-pid", type=int, default=None, help="exit once this process is gone")
    args = parser.parse_args(argv)
    return run_embedded(args.campaign, args.dag_id, args.driver_pid)


if __name__ == "__main__":
    sys.exit(main())
