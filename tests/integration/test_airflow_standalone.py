"""A real Airflow (`airflow standalone`: scheduler, triggerer, dag processor, API server; SQLite)
runs campaigns on the real dev Slurm cluster, triggered through the REST API v2.

One standalone and one dev cluster serve every test of this module (started once; Airflow is
stopped at the end by the pid `milepost airflow up` recorded).

1. A trigger with a bad override value is refused (400) with the validation message, and
   starts nothing.
2. A 2-block campaign triggered with overrides in `conf`: block 0's run succeeds, its
   `progress` task triggers block 1's run, which succeeds; every stage ran as a Slurm job
   while its task was *deferred*; the lease is given back at the end.
3. The run_steps stage's Slurm job is cancelled mid-block: Airflow retries the task, the retry
   resumes from the last checkpoint, and the block ends with the uninterrupted campaign's
   exact weights (sync mode, CPU). A stop request ends that campaign after the block.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from milepost.core.records import BLOCK_STAGES

ROOT = Path(__file__).resolve().parents[2]
DAG_ID = "milepost_tiny_arith"
STEPS = 4
BLOCKS = 2
OVERRIDES = [f"campaign.num_blocks={BLOCKS}", f"campaign.steps_per_block={STEPS}", "checkpoint.every_steps=2",
             "rollout.prompts_per_step=8", "rollout.num_samples_per_prompt=4", "model.tiny.warmstart_steps=60",
             "eval.num_prompts=32", f"data.num_train_rows={BLOCKS * STEPS * 8}",
             "filters.drop_zero_variance_groups=false",
             "cluster.executor=slurm", "cluster.num_nodes=2", "cluster.slurm.time_min=30"]
GUARD_S = 900  # against hanging forever, not a timing assertion


@pytest.fixture(scope="module")
def airflow(tmp_path_factory, dev_cluster) -> Any:
    from milepost import airflow_cmd

    work = tmp_path_factory.mktemp("airflow")
    cache = work / "cache"
    listing = work / "campaigns.yaml"
    listing.write_text(f"- recipe: {ROOT / 'recipes' / 'tiny-arith.yaml'}\n  campaign_url: {work / 'default'}\n"
                       "  poll_interval_s: 2\n  retry_delay_s: 5\n")
    # The tiny model is built once here, so that no stage job pays for it.
    build = ("import sys; from milepost.core.recipe_io import load_recipe; "
             "from milepost.core.model.loading import resolve_model_path; "
             "r = load_recipe('recipes/tiny-arith.yaml', sys.argv[1:]); resolve_model_path(r.model, r.seed)")
    subprocess.run([sys.executable, "-c", build, *OVERRIDES], cwd=ROOT, check=True, timeout=900,
                   env={**os.environ, "MILEPOST_CACHE": str(cache)}, capture_output=True)
    state = airflow_cmd.up(work, parallelism=4, no_auth=True,
                           env_extra={"MILEPOST_CAMPAIGNS_FILE": str(listing), "MILEPOST_CACHE": str(cache)})
    try:
        api = Api(state["url"])
        deadline = time.monotonic() + 180
        while api.call("GET", f"/dags/{DAG_ID}")[0] != 200:  # the dag processor's first parse
            assert time.monotonic() < deadline, f"{DAG_ID} never appeared; see {state['log']}"
            time.sleep(2)
        assert api.call("PATCH", f"/dags/{DAG_ID}", {"is_paused": False})[0] == 200
        api.work = work
        yield api
    finally:
        assert airflow_cmd.down(work), "the standalone was not running any more at the end"


class Api:
    def __init__(self, url: str) -> None:
        self.url = url
        self.work: Path = Path()

    def call(self, method: str, path: str, body: dict | None = None) -> tuple[int, Any]:
        request = urllib.request.Request(f"{self.url}/api/v2{path}", method=method,
                                         data=None if body is None else json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=30) as r:
                return r.status, json.loads(r.read() or b"null")
        except urllib.error.HTTPError as e:
            return e.code, e.read().decode()

    def trigger(self, conf: dict) -> tuple[int, Any]:
        return self.call("POST", f"/dags/{DAG_ID}/dagRuns", {"logical_date": None, "conf": conf})

    def runs(self) -> list[dict]:
        return self.call("GET", f"/dags/{DAG_ID}/dagRuns?limit=100")[1]["dag_runs"]

    def task_states(self, run_id: str) -> dict[str, tuple[str, int]]:
        doc = self.call("GET", f"/dags/{DAG_ID}/dagRuns/{run_id}/taskInstances")[1]
        return {t["task_id"]: (t["state"], t["try_number"]) for t in doc["task_instances"]}

    def wait_run(self, run_id: str, watch: Any = None) -> tuple[str, set[tuple[str, str]]]:
        """The run's final state, and every (task, state) seen while polling it."""
        seen: set[tuple[str, str]] = set()
        deadline = time.monotonic() + GUARD_S
        while True:
            status, run = self.call("GET", f"/dags/{DAG_ID}/dagRuns/{run_id}")
            assert status == 200, run
            seen |= {(task, state) for task, (state, _) in self.task_states(run_id).items()}
            if watch:
                watch()
            if run["state"] in ("success", "failed"):
                return run["state"], seen
            assert time.monotonic() < deadline, f"run {run_id} not done after {GUARD_S}s: {self.task_states(run_id)}"
            time.sleep(1.0)


def _record(campaign: Path, block: int, stage: str) -> dict:
    from milepost.core.records import stage_record_path

    path = campaign / stage_record_path(block, stage)
    return json.loads(path.read_text()) if path.exists() else {}


def test_a_bad_override_is_refused_with_the_validation_message_and_starts_nothing(airflow) -> None:
    before = len(airflow.runs())
    status, body = airflow.trigger({"campaign_url": str(airflow.work / "bad"), "block": 0,
                                    "overrides": ["train.lr"]})
    assert status == 400, body
    assert "Invalid input for param overrides" in body and "does not match" in body
    status, body = airflow.trigger({"campaign_url": str(airflow.work / "bad"), "block": -1, "overrides": []})
    assert status == 400 and "Invalid input for param block" in body
    assert len(airflow.runs()) == before
    assert not (airflow.work / "bad").exists()


@pytest.fixture(scope="module")
def reference(airflow) -> tuple[Path, set, set]:
    """The uninterrupted 2-block campaign: (campaign, task states seen in block 0's run, in block 1's)."""
    from milepost.dags.progress import next_run_id

    campaign = airflow.work / "reference"
    status, run = airflow.trigger({"campaign_url": str(campaign), "block": 0, "overrides": OVERRIDES})
    assert status == 200, run
    state, seen = airflow.wait_run(run["dag_run_id"])
    assert state == "success", airflow.task_states(run["dag_run_id"])
    second = next_run_id(1, run["dag_run_id"])  # triggered by block 0's progress task
    state, seen_1 = airflow.wait_run(second)
    assert state == "success", airflow.task_states(second)
    return campaign, seen, seen_1


def test_a_campaign_runs_its_blocks_as_dag_runs_with_stages_deferred_on_slurm(airflow, reference) -> None:
    campaign, seen, seen_1 = reference
    for block, observed in ((0, seen), (1, seen_1)):
        for stage in BLOCK_STAGES:
            assert (stage, "deferred") in observed, (block, stage, sorted(observed))
            assert _record(campaign, block, stage)["slurm_job_id"], (block, stage)
    assert [b["conf"]["block"] for b in airflow.runs() if b["conf"].get("campaign_url") == str(campaign)] == [0, 1]
    assert json.loads((campaign / "blocks/000001/gate.json").read_text())["verdict"] == "pass"
    assert not (campaign / "lease.json").exists(), "the last run's teardown gives the lease back"


@pytest.mark.extended  # CI: a Slurm stage job lost mid-block resumes in test_slurm_campaign.py
def test_a_killed_run_steps_job_is_retried_and_resumes_to_the_same_weights(airflow, reference) -> None:
    from milepost.core.store import CampaignStore
    from milepost.tasks.progression import request_stop

    reference = reference[0]
    campaign = airflow.work / "killed"
    status, run = airflow.trigger({"campaign_url": str(campaign), "block": 0, "overrides": OVERRIDES})
    assert status == 200, run
    killed: list[str] = []

    def kill_train_mid_block() -> None:
        deadline = time.monotonic() + GUARD_S
        while time.monotonic() < deadline:
            train = _record(campaign, 0, "run_steps") if campaign.exists() else {}
            metrics = campaign / "blocks/000000/metrics.jsonl"
            steps = len(metrics.read_text().splitlines()) if metrics.exists() else 0
            # After the step-2 checkpoint and before the block's last step (step 3 done).
            if train.get("state") == "running" and train.get("slurm_job_id") and 3 <= steps < STEPS:
                subprocess.run(["scancel", train["slurm_job_id"]], check=True)
                killed.append(train["slurm_job_id"])
                request_stop(CampaignStore(str(campaign)), by="test")  # end the campaign after this block
                return
            if train.get("state") == "done":
                return
            time.sleep(0.1)

    killer = threading.Thread(target=kill_train_mid_block, daemon=True)
    killer.start()
    state, _ = airflow.wait_run(run["dag_run_id"])
    killer.join(5)
    assert killed, "the run_steps job was never seen mid-block"
    tasks = airflow.task_states(run["dag_run_id"])
    assert state == "success" and tasks["run_steps"] == ("success", 2), tasks  # failed once, retried once
    train = _record(campaign, 0, "run_steps")
    assert train["slurm_job_id"] != killed[0]
    assert train["model_sha256"] == _record(reference, 0, "run_steps")["model_sha256"]
    rows = [json.loads(line) for line in (campaign / "blocks/000000/metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    assert tasks["progress"][0] == "success"
    assert [b for b in airflow.runs() if b["conf"].get("campaign_url") == str(campaign)][1:] == [], \
        "a stop request starts no next block"
