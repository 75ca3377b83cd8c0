"""The DAG files in dags/ parse cleanly and cheaply: no import errors, the block's tasks and
edges, typed params that refuse a bad override, no connection and no torch/ray/transformers
at parse time; the stage trigger serializes and fires the right events."""

from __future__ import annotations

import asyncio
import copy
import itertools
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

try:
    import airflow.sdk  # noqa: F401
except ImportError as e:  # a missing test dependency is a failure, not a skip
    raise ImportError(f"{e}: the DAG tests need Airflow; install the test extras: "
                      "pip install -e '.[test]'") from None

ROOT = Path(__file__).resolve().parents[2]
DAGS = ROOT / "dags"
RECIPES = sorted((ROOT / "recipes").glob("*.yaml"))
STAGES = ("start_ray", "start_engines", "run_steps", "publish", "evaluate")  # the task ids, in order


def _expected_dag_ids() -> set[str]:
    import yaml

    from milepost.core.records import dag_id_for

    return {dag_id_for((yaml.safe_load(p.read_text()).get("campaign") or {}).get("name") or p.stem) for p in RECIPES}


EXPECTED_DAGS = _expected_dag_ids()


@pytest.fixture(autouse=True)
def airflow_home(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> Path:
    home = tmp_path_factory.getbasetemp() / "airflow-home"
    home.mkdir(exist_ok=True)
    monkeypatch.setenv("AIRFLOW_HOME", str(home))
    monkeypatch.delenv("MILEPOST_CAMPAIGNS_FILE", raising=False)
    return home


def _dagbag(folder: Path = DAGS):
    from airflow.dag_processing.dagbag import DagBag

    return DagBag(dag_folder=str(folder))


def test_every_dag_file_imports_with_no_errors() -> None:
    bag = _dagbag()
    assert bag.import_errors == {}
    assert EXPECTED_DAGS and set(bag.dags) == EXPECTED_DAGS


def test_block_tasks_edges_and_settings() -> None:
    from airflow.sdk import TriggerRule

    dag = _dagbag().dags["milepost_tiny_arith"]
    assert {t.task_id for t in dag.tasks} == {*STAGES, "progress", "teardown", "block_failed"}
    for upstream, downstream in itertools.pairwise(STAGES):
        assert dag.get_task(upstream).downstream_task_ids == {downstream, "block_failed"} | (
            {"teardown"} if upstream == "start_ray" else set())
    assert dag.get_task("evaluate").downstream_task_ids == {"progress", "block_failed"}
    assert dag.get_task("progress").downstream_task_ids == {"teardown"}
    assert dag.get_task("teardown").upstream_task_ids == {"start_ray", "progress"}
    assert dag.get_task("teardown").trigger_rule == TriggerRule.ALL_DONE
    assert dag.get_task("block_failed").trigger_rule == TriggerRule.ONE_FAILED
    assert dag.get_task("block_failed").upstream_task_ids == set(STAGES)
    assert dag.max_active_runs == 1
    assert {"milepost", "recipe:tiny-arith"} <= set(dag.tags)
    assert "one run of this dag is one block" in dag.doc_md.lower()
    assert dag.get_task("run_steps").retries == 1  # cluster.max_block_retries' default
    assert dag.params.dump() == {"campaign_url": str(ROOT / "runs" / "tiny-arith"), "block": 0, "overrides": [],
                                 "resume": False}


def test_dag_survives_serialization_as_the_scheduler_stores_it() -> None:
    from airflow.serialization.serialized_objects import DagSerialization

    dag = _dagbag().dags["milepost_tiny_arith"]
    back = DagSerialization.from_dict(DagSerialization.to_dict(dag))
    assert sorted(t.task_id for t in back.tasks) == sorted(t.task_id for t in dag.tasks)
    assert back.max_active_runs == 1 and back.params.dump() == dag.params.dump()
    assert back.get_task("teardown").trigger_rule == "all_done"


def test_params_refuse_a_bad_override_and_accept_good_ones() -> None:
    from airflow.sdk.exceptions import ParamValidationError

    dag = _dagbag().dags["milepost_tiny_arith"]
    good = copy.deepcopy(dag.params)
    good["overrides"] = ["train.lr=1e-4", "seed=3", "cluster.slurm.partition=gpu"]
    good["block"] = 2
    assert good.validate()["overrides"][0] == "train.lr=1e-4"
    for key, bad in [("overrides", ["bogus.key=1"]), ("overrides", ["train.lr"]), ("overrides", "train.lr=1"),
                     ("block", -1), ("block", "one"), ("campaign_url", "")]:
        params = copy.deepcopy(dag.params)
        with pytest.raises(ParamValidationError, match=f"Invalid input for param {key}"):
            params[key] = bad


def test_recipe_sections_match_the_recipe_schema() -> None:
    from milepost.core.config import Recipe
    from milepost.dags.params import RECIPE_SECTIONS, check_override

    assert set(RECIPE_SECTIONS) == set(Recipe.model_fields)
    check_override("train.lr=1e-4")
    with pytest.raises(ValueError, match="section.key=value"):
        check_override("trian.lr=1e-4")


def test_campaigns_file_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    folder = tmp_path / "dags"
    folder.mkdir()
    (folder / "campaigns.py").write_text((DAGS / "campaigns.py").read_text().replace(
        'Path(__file__).resolve().parent.parent / "recipes"', f'Path({str(ROOT / "recipes")!r})'))
    listing = tmp_path / "campaigns.yaml"
    listing.write_text(f"- recipe: {RECIPES[0]}\n  dag_id: team_a_run\n  campaign_url: s3://b/c\n  tags: [team-a]\n")
    monkeypatch.setenv("MILEPOST_CAMPAIGNS_FILE", str(listing))
    bag = _dagbag(folder)
    assert bag.import_errors == {} and list(bag.dags) == ["team_a_run"]
    dag = bag.dags["team_a_run"]
    assert dag.params["campaign_url"] == "s3://b/c" and "team-a" in dag.tags


PARSE_PROBE = r"""
import json, socket, sys
attempts = []
def refuse(self, address, *a, **k):
    attempts.append(repr(address))
    raise OSError("no connection may be opened at DAG parse time")
socket.socket.connect = refuse
socket.socket.connect_ex = refuse
socket.create_connection = lambda address, *a, **k: refuse(None, address)
from airflow.dag_processing.dagbag import DagBag
bag = DagBag(dag_folder=sys.argv[1])
heavy = sorted(m for m in ("torch", "ray", "transformers", "megatron", "sglang", "milepost.core.config",
                           "milepost.tasks.stage", "submitit") if m in sys.modules)
print("RESULT " + json.dumps({"errors": {str(k): str(v) for k, v in bag.import_errors.items()},
                              "dags": sorted(bag.dags), "heavy": heavy, "connections": attempts}))
"""


def test_parse_opens_no_connection_and_imports_nothing_heavy(airflow_home: Path) -> None:
    env = {**os.environ, "AIRFLOW_HOME": str(airflow_home)}
    done = subprocess.run([sys.executable, "-c", PARSE_PROBE, str(DAGS)], capture_output=True, text=True,
                          env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    line = next(out for out in done.stdout.splitlines() if out.startswith("RESULT "))
    result = json.loads(line[len("RESULT "):])
    assert result["errors"] == {}
    assert result["dags"] == sorted(EXPECTED_DAGS)
    assert result["heavy"] == [], f"imported at parse time: {result['heavy']}"
    assert result["connections"] == []


# --- the trigger ----------------------------------------------------------------------------------
def _trigger(url: str, executor: str = "local", job_id: str = "1", **kw):
    from milepost.dags.triggers import StageJobTrigger

    return StageJobTrigger(url, 0, "run_steps", executor, job_id, kw.pop("submitted_at", time.time()),
                           poll_interval_s=0.05, **kw)


def test_trigger_serialization_round_trip() -> None:
    import importlib

    trigger = _trigger("s3://bucket/camp", "slurm", "1234", pid_created_at=None)
    classpath, kwargs = trigger.serialize()
    assert classpath == "milepost.dags.triggers.StageJobTrigger"
    json.dumps(kwargs)  # plain values only
    module, name = classpath.rsplit(".", 1)
    again = getattr(importlib.import_module(module), name)(**kwargs)
    assert again.serialize() == (classpath, kwargs)
    with pytest.raises(ValueError, match="executor"):
        _trigger("x", "k8s")


async def _first_event(trigger):
    async for event in trigger.run():
        return event.payload


def test_local_trigger_fires_done_when_the_stage_records_done(tmp_path: Path) -> None:
    import psutil

    from milepost.core.store import CampaignStore

    store = CampaignStore(str(tmp_path))
    job = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(0.5)"])
    try:
        trigger = _trigger(str(tmp_path), job_id=str(job.pid), pid_created_at=psutil.Process(job.pid).create_time())

        async def scenario():
            waiting = asyncio.ensure_future(_first_event(trigger))
            await asyncio.sleep(0.2)
            assert not waiting.done()
            store.write_stage_record(0, "run_steps", {"state": "done", "finished_at": time.time()})
            return await asyncio.wait_for(waiting, 10)

        event = asyncio.run(scenario())
    finally:
        job.wait()
    assert event["status"] == "done" and event["job_id"] == str(job.pid) and event["block"] == 0


def test_local_trigger_fires_failed_when_the_job_ends_without_done(tmp_path: Path) -> None:
    from milepost.core.store import CampaignStore

    store = CampaignStore(str(tmp_path))
    store.write_stage_record(0, "run_steps", {"state": "done", "finished_at": time.time() - 3600})  # an old run's
    job = subprocess.Popen([sys.executable, "-c", "raise SystemExit(1)"])
    job.wait()
    event = asyncio.run(asyncio.wait_for(_first_event(_trigger(str(tmp_path), job_id=str(job.pid))), 10))
    assert event["status"] == "failed" and "without recording the stage done" in event["detail"]


def test_slurm_trigger_reports_the_terminal_outcome(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from milepost.core.store import CampaignStore
    from milepost.slurm import state as slurm_state

    seen = iter([slurm_state.Outcome.PENDING, slurm_state.Outcome.RUNNING, slurm_state.Outcome.CANCELLED])

    async def poll(self):
        outcome = next(seen)
        return slurm_state.JobState(self.job_id, outcome, outcome.value.upper())

    monkeypatch.setattr(slurm_state.SlurmStatePoller, "poll", poll)
    CampaignStore(str(tmp_path)).write_stage_record(0, "run_steps", {"state": "running"})
    event = asyncio.run(asyncio.wait_for(_first_event(_trigger(str(tmp_path), "slurm", "77")), 10))
    assert event["status"] == "failed" and event["outcome"] == "cancelled" and event["record_state"] == "running"


# --- the operator, without a scheduler ------------------------------------------------------------
def _operator(stage: str):
    from milepost.dags.operators import StageOperator

    return StageOperator(task_id=stage, stage=stage, recipe_path=str(RECIPES[0]))


def test_operator_skips_a_done_stage_and_a_done_block(tmp_path: Path) -> None:
    from milepost.core.store import CampaignStore

    store = CampaignStore(str(tmp_path))
    store.write_text_atomic("campaign.yaml", (ROOT / "recipes" / "tiny-arith.yaml").read_text())
    store.write_stage_record(0, "run_steps", {"state": "done", "pid": 4242})
    context = {"params": {"campaign_url": str(tmp_path), "block": 0, "overrides": [], "resume": False},
               "dag": _dagbag().dags["milepost_tiny_arith"], "run_id": "manual__test"}
    assert _operator("run_steps").execute(context) == {"campaign_url": str(tmp_path), "block": 0, "stage": "run_steps",
                                                   "job_id": "4242"}
    store.write_stage_record(0, "evaluate", {"state": "done"})
    store.write_stage_record(0, "start_ray", {"state": "released"})
    assert _operator("start_ray").execute(context)["stage"] == "start_ray"  # nothing submitted


def test_operator_refuses_a_bad_override_without_retrying(tmp_path: Path) -> None:
    from airflow.sdk.exceptions import AirflowFailException

    context = {"params": {"campaign_url": str(tmp_path / "c"), "block": 0, "overrides": ["train.lr=fast"]}}
    with pytest.raises(AirflowFailException, match="train.lr"):
        _operator("start_ray").execute(context)


def test_operator_fails_with_the_stage_log_on_a_failed_event(tmp_path: Path) -> None:
    from milepost.dags.operators import StageFailedError

    event = {"status": "failed", "campaign_url": str(tmp_path), "block": 1, "stage": "run_steps", "job_id": "9",
             "detail": "Slurm job 9 ended cancelled"}
    with pytest.raises(StageFailedError, match=r"block 1 stage run_steps failed: Slurm job 9 ended cancelled "
                                               r"\(stage log: /l\)"):
        _operator("run_steps").execute_complete({}, event, stderr_path="/l")
    assert _operator("run_steps").execute_complete({}, {**event, "status": "done"}) == {
        "campaign_url": str(tmp_path), "block": 1, "stage": "run_steps", "job_id": "9"}


def test_operator_shows_the_recorded_root_error_and_does_not_retry_a_user_error(tmp_path: Path) -> None:
    from airflow.sdk.exceptions import AirflowFailException

    from milepost.core.store import CampaignStore
    from milepost.dags.operators import StageFailedError

    store = CampaignStore(str(tmp_path))
    event = {"status": "failed", "campaign_url": str(tmp_path), "block": 0, "stage": "run_steps", "job_id": "9",
             "detail": "local job 9 ended without recording the stage done"}
    store.write_stage_record(0, "run_steps", {"state": "failed", "error": "OSError: disk full", "error_kind": "runtime",
                                          "log": "/jobs/9.err"})
    with pytest.raises(StageFailedError, match=r"run_steps failed: OSError: disk full \(stage log: /jobs/9.err\)"):
        _operator("run_steps").execute_complete({}, event)
    store.write_stage_record(0, "run_steps", {"state": "failed", "error": "UserError: reward `x` raised",
                                          "error_kind": "user", "log": "/jobs/9.err"})
    with pytest.raises(AirflowFailException, match="(?s)UserError: reward `x` raised.*not retried"):
        _operator("run_steps").execute_complete({}, event)


def test_operator_records_stage_timings_from_the_event(tmp_path: Path) -> None:
    """The trigger's event carries submitted_at and the job log (dag.test() keeps only the
    event when it resumes a deferred task), and the operator writes blocks/N/timings.json."""
    from milepost.core.store import CampaignStore

    store = CampaignStore(str(tmp_path))
    store.write_stage_record(0, "run_steps", {"state": "done", "started_at": 100.0, "finished_at": 160.0})
    event = {"status": "done", "campaign_url": str(tmp_path), "block": 0, "stage": "run_steps", "job_id": "7",
             "executor": "local", "submitted_at": 95.0, "stderr_path": "/l"}
    _operator("run_steps").execute_complete({}, event)
    stages = store.read_json("blocks/000000/timings.json")["stages"]
    assert stages["run_steps"]["job_id"] == "7" and stages["run_steps"]["submitted_at"] == 95.0
    assert stages["run_steps"]["started_at"] == 100.0 and stages["run_steps"]["returned_at"] >= 160.0
    with pytest.raises(Exception, match="stage log: /l"):
        _operator("run_steps").execute_complete({}, {**event, "status": "failed", "detail": "x"})
