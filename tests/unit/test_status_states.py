"""`milepost status` tells the truth per block: done, running (only while a live process holds
the lease), failed with its root error, paused with the gate's reason, interrupted when
nothing holds the lease any more; `--json` carries the same. Built from real store files and
real leases (this process's pid; a process that has exited)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from milepost.core.records import BLOCK_STAGES, Stage, StageRecord, StageState
from milepost.core.store import CampaignStore
from milepost.tasks import lease
from milepost.tasks.status import block_state, campaign_status, format_status


@pytest.fixture
def store(tmp_path) -> CampaignStore:
    s = CampaignStore(str(tmp_path / "campaign"))
    s.write_text_atomic("campaign.yaml", "seed: 1\n")
    return s


def _done_block(store: CampaignStore, block: int, accuracy: float) -> None:
    for stage in BLOCK_STAGES:
        store.write_stage_record(block, stage, {"state": "done", "eval": {"accuracy": accuracy}})
    store.write_metrics(block, [{"step": 2 * block + 2, "rollout/reward_mean": 0.5, "loss/kl": 0.001,
                                 "timing/step_s": 1.25}])


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_a_finished_block_is_done_with_its_last_metrics(store) -> None:
    _done_block(store, 0, 0.68)
    store.write_json("blocks/000000/gate.json", {"verdict": "pass"})
    doc = campaign_status(store.url)
    block = doc["blocks"][0]
    assert (block["state"], block["status"], block["gate"]) == ("done", "done", "pass")
    assert block["last_metrics"] == {"step": 2, "rollout/reward_mean": 0.5, "loss/kl": 0.001, "timing/step_s": 1.25}
    text = format_status(doc)
    assert "block 0: done" in text and "accuracy 0.680, gate pass; last step 2: reward 0.500, kl 0.0010" in text


def test_a_block_is_running_only_while_a_live_process_holds_the_lease(store) -> None:
    _done_block(store, 0, 0.68)
    store.write_stage_record(1, "start_ray", {"state": "done"})
    store.write_stage_record(1, "run_steps", {"state": "running", "pid": os.getpid()})
    lease.acquire(store, "milepost-run:test", pid=os.getpid())
    doc = campaign_status(store.url)
    assert doc["blocks"][1]["status"] == "running: run_steps" and doc["blocks"][0]["state"] == "done"
    assert doc["lease"]["owner"] == "milepost-run:test"
    # The same records once the holder is gone (a SIGKILLed `milepost run`): not running.
    lease.release(store, "milepost-run:test")
    lease.acquire(store, "milepost-run:killed", pid=os.getpid())
    doc_lease = store.read_json("lease.json")
    store.write_json("lease.json", {**doc_lease, "pid": _dead_pid()})
    doc = campaign_status(store.url)
    assert doc["blocks"][1]["state"] == "interrupted" and doc["lease"] is None
    assert "`milepost run` resumes it" in doc["blocks"][1]["status"]


def test_an_expired_airflow_lease_is_not_a_live_run(store) -> None:
    store.write_stage_record(0, "run_steps", {"state": "running"})
    store.write_json("lease.json", {"owner": "airflow:milepost_x/run", "host": "elsewhere", "expires_at": 1.0})
    assert campaign_status(store.url)["blocks"][0]["state"] == "interrupted"
    store.write_json("lease.json", {"owner": "airflow:milepost_x/run", "host": "elsewhere", "expires_at": 4e9})
    assert campaign_status(store.url)["blocks"][0]["status"] == "running: run_steps"


def test_a_failed_stage_shows_its_root_error_in_text_and_json(store) -> None:
    store.write_stage_record(0, "start_ray", {"state": "done"})
    store.write_stage_record(0, "run_steps", {"state": "failed", "error": "RuntimeError: the disk went away",
                                          "error_kind": "runtime", "log": "/jobs/1_0_log.err", "failed_at": 5.0})
    doc = json.loads(json.dumps(campaign_status(store.url)))  # what --json prints
    block = doc["blocks"][0]
    assert block["state"] == "failed"
    assert block["status"] == "failed: stage run_steps: RuntimeError: the disk went away"
    assert block["failure"]["error_kind"] == "runtime" and block["failure"]["log"] == "/jobs/1_0_log.err"
    assert "runtime error; RuntimeError: the disk went away (stage log: /jobs/1_0_log.err)" in format_status(doc)


def test_a_failed_block_being_retried_by_a_live_run_is_running(store) -> None:
    store.write_stage_record(0, "run_steps", {"state": "failed", "error": "E", "failed_at": 5.0})
    store.write_stage_record(0, "start_ray", {"state": "running"})
    lease.acquire(store, "milepost-run:retry", pid=os.getpid())
    assert campaign_status(store.url)["blocks"][0]["status"] == "running: start_ray"


def test_a_block_that_paused_the_campaign_says_why(store) -> None:
    _done_block(store, 0, 0.70)
    _done_block(store, 1, 0.50)
    reason = "block 1 accuracy 0.500 is more than 0.05 below the best block 0 (0.700)"
    store.write_json("progress.json", {"paused": {"block": 1, "reason": reason}, "best": None})
    blocks = campaign_status(store.url)["blocks"]
    assert [b["state"] for b in blocks] == ["done", "paused"]
    assert blocks[1]["status"] == f"paused: {reason}"


def test_a_stop_request_pauses_after_the_newest_done_block(store) -> None:
    _done_block(store, 0, 0.70)
    store.write_json("progress.json", {"stop_requested": {"by": "alice", "at": 1.0}})
    assert campaign_status(store.url)["blocks"][0]["status"] == "paused: a stop was requested (alice)"


def test_states_from_records_alone() -> None:
    assert block_state({}, None, None) == ("pending", "")
    running, done = StageRecord(StageState.RUNNING), StageRecord(StageState.DONE)
    assert block_state({Stage.START_RAY: running}, {"owner": "x"}, None) == ("running", "start_ray")
    assert block_state({Stage.START_RAY: done}, {"owner": "x"}, None) == ("running", "between stages")
    assert block_state({Stage.EVALUATE: done}, {"owner": "x"}, None) == ("done", "")
