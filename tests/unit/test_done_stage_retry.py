"""A stage task that runs again after its stage was recorded done (a cleared task, or Airflow
3.3.2's false "Up For Retry" after a success, apache/airflow#67287) ends at once: nothing is
submitted, and blocks/N/timings.json keeps the first try's timing."""

from __future__ import annotations

from pathlib import Path

from milepost.core.recipe_io import dump_recipe, load_recipe
from milepost.core.store import CampaignStore
from milepost.dags.operators import StageOperator

RECIPE = str(Path(__file__).resolve().parents[2] / "recipes" / "tiny-arith.yaml")
FIRST_TRY = {"job_id": "4242", "submitted_at": 1000.0, "started_at": 1002.0, "finished_at": 1062.0,
             "returned_at": 1065.0, "log": "/c/jobs/4242_0_log.err"}


def _store(tmp_path: Path) -> CampaignStore:
    store = CampaignStore(str(tmp_path / "c"))
    store.write_text_atomic("campaign.yaml", dump_recipe(load_recipe(RECIPE, [])))
    store.write_stage_record(0, "run_steps", {"state": "done", "started_at": 1002.0, "finished_at": 1062.0,
                                          "pid": 4242, "log": FIRST_TRY["log"], "steps": [1, 2]})
    return store


def _retry(store: CampaignStore) -> dict:
    op = StageOperator(task_id="run_steps", stage="run_steps", recipe_path=RECIPE)
    # No `ti`: nothing may defer or push; a submission would fail for want of one.
    return op.execute({"params": {"campaign_url": store.url, "block": 0, "overrides": []}})


def test_a_done_stage_run_again_ends_at_once_and_keeps_the_first_tries_timing(tmp_path: Path, capsys) -> None:
    store = _store(tmp_path)
    store.write_json("blocks/000000/timings.json", {"executor": "local", "stages": {"run_steps": FIRST_TRY}})
    out = _retry(store)
    assert out == {"campaign_url": store.url, "block": 0, "stage": "run_steps", "job_id": "4242"}
    assert store.read_json("blocks/000000/timings.json")["stages"]["run_steps"] == FIRST_TRY
    assert not store.exists("jobs")  # nothing submitted
    text = capsys.readouterr().out  # the task log (Airflow's structlog writes to stdout here)
    assert "already done by an earlier try" in text and "(1 min 0 s)" in text and FIRST_TRY["log"] in text
    assert "1000.0" not in text and "1062" not in text  # local times, never an epoch number


def test_a_first_try_that_ended_before_writing_its_timing_gets_it_from_its_record(tmp_path: Path, capsys) -> None:
    store = _store(tmp_path)
    _retry(store)
    entry = store.read_json("blocks/000000/timings.json")["stages"]["run_steps"]
    assert (entry["started_at"], entry["finished_at"], entry["from_record"]) == (1002.0, 1062.0, True)
