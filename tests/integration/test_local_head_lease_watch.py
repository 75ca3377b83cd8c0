"""A local Ray head's lease watch (tasks/lease_watch.py, started by tasks/local_ray.py beside
every local head): with a real `ray start --head`, a driver that holds the campaign's lease
and is then SIGKILLed (teardown never comes) gets its head, and every process of it, stopped
after the grace; a head torn down the normal way ends the watch by itself. End to end: a
SIGKILLed `milepost run` of tiny-arith leaves no Ray process and no engine behind once
`cluster.orphan_grace_s` has passed."""

from __future__ import annotations

import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
import pytest

from milepost.core.store import CampaignStore
from milepost.tasks.local_ray import collect, free_ray_ports, start_lease_watch, start_local_head, stop_processes
from milepost.tasks.ray_auth import campaign_ray_auth, ray_auth_env

# The helpers that run a campaign and read its store are shared with tests/faults.
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "faults"))
import fault_campaign as cp

GUARD_S = 120  # against hanging, not a timing assertion
LEASE_HOLDER = """import os, sys, time
from milepost.core.store import CampaignStore
from milepost.tasks.lease import acquire, local_owner
acquire(CampaignStore(sys.argv[1]), local_owner(), ttl_s=600, pid=os.getpid())
print("held", flush=True)
time.sleep(600)
"""


def _head(tmp_path: Path, store: CampaignStore) -> tuple[dict, str]:
    temp_dir = tempfile.mkdtemp(prefix="mp-ray-", dir="/tmp")  # short: Ray's socket paths
    pids: list = []
    try:
        with campaign_ray_auth(store):  # as run_stage does: the head and this process share the campaign's token
            head = start_local_head(free_ray_ports(store.url), temp_dir, tmp_path / "head.log", ray_auth_env(store),
                                    lambda pid, at: pids.append((pid, at)))
    except Exception:
        stop_processes(pids, temp_dir, [], since=0.0)
        raise
    return head, temp_dir


def _running(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _wait_exit(pid: int, what: str) -> None:
    deadline = time.monotonic() + GUARD_S
    while _running(pid):
        assert time.monotonic() < deadline, what
        time.sleep(0.3)


def test_a_killed_drivers_local_head_is_stopped_after_the_grace(tmp_path) -> None:
    store = CampaignStore(str(tmp_path / "campaign"))
    driver = subprocess.Popen([sys.executable, "-c", LEASE_HOLDER, store.url], stdout=subprocess.PIPE, text=True)
    assert driver.stdout is not None and driver.stdout.readline().strip() == "held"
    head, temp_dir = _head(tmp_path, store)
    pids = list(zip(head["pids"], head["pids_created_at"]))
    log = tmp_path / "lease-watch.log"
    try:
        watch = start_lease_watch(store.url, head, temp_dir, 2.0, log)
        time.sleep(5)  # the driver lives: the head stays
        assert collect(pids, None, [], 0.0), "the head stopped while its driver lived"
        driver.kill()
        driver.wait()
        _wait_exit(watch, f"the watch did not end; its log:\n{log.read_text()}")
        assert not [p.pid for p in collect(pids, temp_dir, [], 0.0) if _running(p.pid)], log.read_text()
        text = log.read_text()
        assert "stopping the local Ray head and its engines" in text and "stopped" in text, text
    finally:
        driver.kill()
        stop_processes(pids, temp_dir, [], since=0.0)


def test_a_head_torn_down_ends_its_watch(tmp_path) -> None:
    store = CampaignStore(str(tmp_path / "campaign"))
    head, temp_dir = _head(tmp_path, store)
    pids = list(zip(head["pids"], head["pids_created_at"]))
    log = tmp_path / "lease-watch.log"
    try:
        watch = start_lease_watch(store.url, head, temp_dir, 600.0, log)  # no lease: orphaned, but in 10 min
        time.sleep(2)
        stop_processes(pids, None, [], since=0.0)  # the head and its children, not the watch
        _wait_exit(watch, f"the watch outlived its head; its log:\n{log.read_text()}")
        assert "the local Ray head is gone (torn down)" in log.read_text()
    finally:
        stop_processes(pids, temp_dir, [], since=0.0)


@pytest.mark.slow
def test_a_sigkilled_milepost_run_leaves_no_ray_or_engine_behind(tmp_path, tiny_model_cache) -> None:
    shape = cp.Shape(num_blocks=1, steps_per_block=6, prompts_per_step=4, extra=("cluster.orphan_grace_s=10",))
    campaign, log = tmp_path / "c", tmp_path / "run.log"
    cp.build_model(tiny_model_cache, shape.overrides())
    proc = cp.start(campaign, tiny_model_cache, shape.overrides(), log)
    try:
        assert cp.wait_until(lambda: cp.steps_recorded(campaign) >= 1, proc, 600, "a first step"), log.read_text()
        start, fleet = cp.record(campaign, "start_ray"), cp.fleet_doc(campaign)
        pids = list(zip(start["pids"], start["pids_created_at"]))
        engines = [e["pid"] for e in fleet.get("engines", [])]
        assert engines and collect(pids, start["temp_dir"], [], 0.0)
        proc.send_signal(signal.SIGKILL)  # the driver alone: the head and engines live in the head's session
        proc.wait(30)
        deadline = time.monotonic() + GUARD_S
        while [p for p in collect(pids, start["temp_dir"], [], 0.0) if _running(p.pid)] or \
                any(_running(pid) for pid in engines):
            assert time.monotonic() < deadline, (campaign / "blocks/000000/logs/lease-watch.log").read_text()
            time.sleep(0.5)
        assert "stopping the local Ray head" in (campaign / "blocks/000000/logs/lease-watch.log").read_text()
    finally:
        cp.kill_session(proc)
