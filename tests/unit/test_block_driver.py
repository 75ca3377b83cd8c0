"""The one block driver (tasks/block_driver.py): its retry policy, the stage job's command, a
real local stage job submitted and waited on (timings.json, a failure's message), and the
release of what a killed run left — the policy the DAG's operator, the embedded runner and
the synchronous drivers all go through."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from milepost.core.recipe_io import dump_recipe, load_recipe
from milepost.core.records import Stage, StageRecord, StageState
from milepost.core.store import CampaignStore
from milepost.tasks.block_driver import BlockDriver, StageFailed, retry_block, stage_command

ROOT = Path(__file__).resolve().parents[2]


def _driver(tmp_path: Path, driver_pid: int | None = None) -> BlockDriver:
    store = CampaignStore(str(tmp_path / "c"))
    store.write_text_atomic("campaign.yaml", dump_recipe(load_recipe(ROOT / "recipes/tiny-arith.yaml", [])))
    return BlockDriver(store, driver_pid=driver_pid)


def test_a_runtime_failure_is_retried_until_the_limit_and_a_user_error_never() -> None:
    said: list[str] = []
    failures = iter([StageFailed("lost a node"), StageFailed("lost a node"), StageFailed("lost a node")])
    last = retry_block(3, 2, lambda: next(failures), said.append)
    assert str(last) == "lost a node"
    assert said == ["tearing block 3 down and launching it again (1/2)",
                    "tearing block 3 down and launching it again (2/2)"]

    said.clear()
    assert retry_block(0, 5, lambda: StageFailed("bad reward", user_error=True), said.append).user_error
    assert said == []

    outcomes = iter([StageFailed("cancelled"), None])
    assert retry_block(0, 1, lambda: next(outcomes), said.append) is None


def test_only_a_local_stage_job_is_told_which_process_it_dies_with(tmp_path: Path) -> None:
    assert stage_command("/c", 2, "train") == [sys.executable, "-m", "milepost.tasks.stage", "--campaign", "/c",
                                               "--block", "2", "--stage", "run_steps"]  # an old name is read
    assert stage_command("/c", 0, Stage.TEARDOWN, 4242)[-2:] == ["--driver-pid", "4242"]


def test_a_stage_job_is_submitted_waited_on_and_timed(tmp_path: Path) -> None:
    driver = _driver(tmp_path, driver_pid=None)
    driver.run_stage(0, Stage.TEARDOWN)  # nothing launched: it releases nothing, as a real job
    assert driver.store.stage_done(0, Stage.TEARDOWN)
    timings = driver.store.read_json("blocks/000000/timings.json")
    entry = timings["stages"]["teardown"]
    assert timings["executor"] == "local" and entry["log"].endswith("_log.err") and entry["job_id"]
    assert entry["submitted_at"] <= entry["started_at"] <= entry["finished_at"] <= entry["returned_at"]


def test_a_failed_stage_names_its_recorded_root_error_and_log(tmp_path: Path) -> None:
    driver = _driver(tmp_path)
    driver.store.write_stage_record(0, "publish", {"state": "failed", "error": "OSError: disk full",
                                                   "error_kind": "runtime", "log": "/jobs/9.err"})
    failure = driver.failure(0, "publish", "local job 9 ended")
    assert str(failure) == "block 0 stage publish failed: OSError: disk full (stage log: /jobs/9.err)"
    assert not failure.user_error
    driver.store.write_stage_record(0, "publish", {"state": "failed", "error": "UserError: x", "error_kind": "user"})
    assert driver.failure(0, "publish", "").user_error


def test_a_done_stage_without_a_timing_gets_one_from_its_record(tmp_path: Path) -> None:
    driver = _driver(tmp_path)
    record = StageRecord(StageState.DONE, started_at=10.0, finished_at=70.0, pid=42, log="/l")
    entry = driver.timing_of_done_stage(0, Stage.RUN_STEPS, record)
    assert (entry["job_id"], entry["submitted_at"], entry["from_record"]) == (42, 10.0, True)
    assert driver.timing_of_done_stage(0, Stage.RUN_STEPS, record) == entry  # kept, not rewritten


@pytest.mark.parametrize("launch, evaluated, released", [("running", False, True), ("released", False, False),
                                                          ("done", True, False)])
def test_only_a_launched_unfinished_block_is_released(tmp_path: Path, launch: str, evaluated: bool,
                                                      released: bool) -> None:
    driver = _driver(tmp_path)
    driver.store.write_stage_record(0, "start_ray", {"state": launch})
    if evaluated:
        driver.store.write_stage_record(0, "evaluate", {"state": "done", "eval": {"accuracy": 0.5}})
    assert driver.release_leftovers(0) is released
    assert (driver.store.stage_record(0, Stage.START_RAY).state is StageState.RELEASED) is (released or
                                                                                          launch == "released")
