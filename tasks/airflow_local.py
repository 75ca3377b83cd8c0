"""Airflow on this machine, for `milepost run` (embedded) and `milepost airflow up|down`.

Embedded mode runs the very DAG a scheduler runs (dags/: one run = one block) through
`dag.test()`, in a child process of `milepost run` (`python -m milepost.tasks.airflow_local
embedded …`), so that Airflow's import, logging set-up and database stay out of the CLI
process. Its AIRFLOW_HOME is `<campaign>/airflow/` (SQLite, migrated on first use), its dags
folder the project's `dags/`, and its campaigns file names only this campaign, with the
campaign's resolved recipe (`<campaign>/campaign.yaml`) as the DAG's recipe.

Each block's DAG run logs to `<campaign>/airflow/logs/block_<NNNNNN>.log` (every task's log,
in order, as the Airflow UI would show them one by one); `milepost run` prints that path when
the block starts. Between blocks the driver applies the same progression decision as the
DAG's `progress` task (`tasks.progression.after_evaluate`, idempotent) and stops on
`done`, `paused` or `stopped`.

The child dies with `milepost run` (`MILEPOST_DRIVER_PID`, as stage jobs do), and its local
stage jobs die with it too (`MILEPOST_EMBEDDED_DRIVER_PID`, read by the stage operator).
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
import time
from pathlib import Path

import yaml
from milepost.core.records import (
    CAMPAIGNS_FILE_ENV,
    DRIVER_PID_ENV,
    EMBEDDED_DRIVER_PID_ENV,
    LEASE_OWNER_ENV,
    RECIPE_DOC,
    Stage,
    StageRecord,
    block_label,
    block_path,
    campaign_id,
)
from milepost.core.store import CampaignStore
from milepost.tasks.failures import block_failure, is_user_error, stage_failure

EXIT_DONE, EXIT_FAILED, EXIT_REFUSED, EXIT_PAUSED = 0, 1, 2, 3
EMBEDDED_POLL_S = 0.5  # how often an in-process trigger looks at a local stage (the default is 5 s)
EMBEDDED_RETRY_DELAY_S = 5.0


def dags_folder() -> Path:
    """Where the DAG files are, found without importing them (tasks/ never imports dags/)."""
    spec = importlib.util.find_spec("milepost.dags")
    assert spec is not None and spec.submodule_search_locations, "milepost.dags is part of the package"
    return Path(next(iter(spec.submodule_search_locations))).resolve()


def embedded_home(store: CampaignStore) -> Path:
    return Path(store.local_path("airflow")).resolve()


def block_log(store: CampaignStore, block: int) -> Path:
    return embedded_home(store) / "logs" / f"{block_label(block)}.log"


def airflow_env(home: Path, campaigns_file: Path | None = None, **extra: str) -> dict[str, str]:
    """The environment of an Airflow of our own: its home, the project's dags, no examples."""
    env = {**os.environ, "AIRFLOW_HOME": str(home), "AIRFLOW__CORE__DAGS_FOLDER": str(dags_folder()),
           "AIRFLOW__CORE__LOAD_EXAMPLES": "False", "AIRFLOW__LOGGING__COLORED_CONSOLE_LOG": "False", **extra}
    if campaigns_file is not None:
        env[CAMPAIGNS_FILE_ENV] = str(campaigns_file)
    return env


def embedded_env(store: CampaignStore, dag_id: str, driver_pid: int, lease_owner: str) -> dict[str, str]:
    home = embedded_home(store)
    (home / "logs").mkdir(parents=True, exist_ok=True)
    listing = home / "campaigns.yaml"
    listing.write_text(yaml.safe_dump([{
        "recipe": os.path.abspath(store.local_path(RECIPE_DOC)), "campaign_url": campaign_id(store.url),
        "dag_id": dag_id, "tags": ["embedded"],
        "poll_interval_s": EMBEDDED_POLL_S, "retry_delay_s": EMBEDDED_RETRY_DELAY_S}]))
    return airflow_env(home, listing, **{EMBEDDED_DRIVER_PID_ENV: str(driver_pid), DRIVER_PID_ENV: str(driver_pid),
                                         LEASE_OWNER_ENV: lease_owner})


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


def run_embedded_blocks(url: str, dag_id: str) -> int:
    """The child's loop: one dag.test() per block until done, paused, stopped or failed."""
    from milepost.tasks.progression import after_evaluate, next_block
    from milepost.tasks.stage import _die_with_driver

    _die_with_driver()
    store = CampaignStore(url)
    recipe = store.load_recipe()
    logs = _BlockLog()
    block = next_block(store, recipe)
    if block is None:
        return EXIT_DONE
    logs.to(block_log(store, block))  # Airflow's start-up output goes to the first block's log
    try:
        ensure_migrated(embedded_home(store))
        from airflow.dag_processing.dagbag import DagBag

        bag = DagBag(dag_folder=str(dags_folder()))
        if bag.import_errors or dag_id not in bag.dags:
            logs.user.write(f"milepost: the campaign's DAG {dag_id} did not load: {bag.import_errors}\n")
            return EXIT_FAILED
        dag = bag.dags[dag_id]
        attempt = 0
        while block is not None:
            logs.to(block_log(store, block))
            started = time.time()
            run = dag.test(run_conf={"campaign_url": url, "block": block, "overrides": [], "resume": False},
                           logical_date=None)
            state = str(getattr(run.state, "value", run.state))
            store.write_json(block_path(block, "dag_run.json"), {
                "mode": "embedded", "dag_id": dag_id, "run_id": run.run_id, "state": state,
                "started_at": started, "ended_at": time.time()})
            failed = block_failure(lambda stage: store.stage_record(block, stage), since=started)
            _note_run(store, block, dag_id, run.run_id, state, failed, logs)
            if state != "success":
                logs.user.write(_failure_message(store, block, state, failed))
                if attempt < recipe.cluster.max_block_retries and not (failed and is_user_error(failed[1])):
                    # The run's teardown released the block; a new run launches it afresh and
                    # train resumes from its last checkpoint (a lost node, a cancelled allocation).
                    attempt += 1
                    logs.user.write(f"milepost: tearing block {block} down and launching it again ({attempt}/"
                                    f"{recipe.cluster.max_block_retries})\n")
                    continue
                return EXIT_REFUSED if failed and is_user_error(failed[1]) else EXIT_FAILED
            attempt = 0
            decision = after_evaluate(store, recipe, block)
            if decision.action != "next":
                logs.user.write(f"milepost: {decision.message}\n")
                return EXIT_DONE if decision.action == "done" else EXIT_PAUSED
            block = decision.next_block
        return EXIT_DONE
    finally:
        logs.back()


def _note_run(store: CampaignStore, block: int, dag_id: str, run_id: str, state: str,
              failed: tuple[Stage, StageRecord] | None, logs: _BlockLog) -> None:
    """The run's note, as a scheduler's run gets it from its tasks (dags/progress.py,
    dags/block_failed.py): under dag.test() there is no API server, so the driver writes it
    into the run's database (the embedded Airflow's UI shows it when pointed at that home)."""
    from milepost.tasks.block_summary import failure_note, format_summary, read_block_summary

    if state == "success":
        note = format_summary(read_block_summary(store, block))
    elif failed:
        stage, record = failed
        note = failure_note(block, stage, record.error or "no error recorded", record.error_kind, record.log)
    else:
        note = failure_note(block, None, f"the run ended {state}; its task log says why", None,
                            str(block_log(store, block)))
    try:
        set_note_in_db(dag_id, run_id, note)
    except Exception as e:  # noqa: BLE001 - a note is a convenience: say why it is missing, go on
        logs.user.write(f"milepost: block {block}'s DAG run note was not set ({type(e).__name__}: {e})\n")


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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="milepost's embedded Airflow (started by `milepost run`)")
    sub = parser.add_subparsers(dest="command", required=True)
    emb = sub.add_parser("embedded", help="run a prepared campaign's blocks through dag.test()")
    emb.add_argument("--campaign", required=True)
    emb.add_argument("--dag-id", required=True)
    args = parser.parse_args(argv)
    return run_embedded_blocks(args.campaign, args.dag_id)


def child_command(url: str, dag_id: str) -> list[str]:
    return [sys.executable, "-m", "milepost.tasks.airflow_local", "embedded", "--campaign", url, "--dag-id", dag_id]


if __name__ == "__main__":
    sys.exit(main())

