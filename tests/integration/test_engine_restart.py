"""In-block fault tolerance: engines SIGKILLed mid-rollout are restarted by the fleet
supervisor (real local Ray, built-in engines, real sglang-router, a tiny random Qwen2)."""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
import ray
from tinymodels import save_tiny_qwen2

from milepost.core.config import RolloutConfig
from milepost.core.fleet.fleet import Fleet, FleetError, FleetTransport
from milepost.core.rollout import RolloutRequest, default_rollout
from milepost.core.types import Prompt, Sample
from milepost.core.weight_export import WeightExports
from milepost.core.weight_sync import build_transport

log = logging.getLogger(__name__)
N = 4  # samples per prompt
PROMPTS = [Prompt(index=i, text="", label="", prompt_ids=[2 + i % 20, 3, 4 + i % 7]) for i in range(48)]
REQUEST = RolloutRequest(PROMPTS, N, {"max_new_tokens": 96, "temperature": 1.0, "ignore_eos": True},
                         sampling_seed=7, num_engines=6, decode=lambda ids: "")


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> tuple[str, str]:
    root = tmp_path_factory.mktemp("models")
    return save_tiny_qwen2(root / "v0", 0), save_tiny_qwen2(root / "v1", 1)


@pytest.fixture(scope="module")
def ray_session():
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


def _config(max_restarts: int, **overrides: Any) -> RolloutConfig:
    settings: dict[str, Any] = dict(num_engines=2, health_check_interval_s=0.5, health_failure_threshold=2,
                                    health_check_timeout_s=20.0, engine_startup_timeout_s=90.0,
                                    request_timeout_s=60.0)
    return RolloutConfig(**{**settings, "max_engine_restarts": max_restarts, **overrides})


@pytest.fixture(scope="module")
def fleet(ray_session, models):
    """Two engines serving v1 as version "1" (a weight sync happened before the kills)."""
    f = Fleet.start(models[0], 2, _config(max_restarts=3), weight_version="0")
    FleetTransport(f, build_transport("disk")).push(f.clients, models[1], "1")
    yield f
    f.stop()


def _samples_by_prompt(samples: list[Sample]) -> dict[int, list[list[int]]]:
    grouped: dict[int, list[list[int]]] = {}
    for s in samples:
        grouped.setdefault(s.prompt_index, []).append(s.response_ids)
    return grouped


def _start_rollout(fleet: Fleet) -> tuple[threading.Thread, dict[str, Any]]:
    box: dict[str, Any] = {}
    rollout = threading.Thread(target=lambda: box.update(samples=default_rollout(REQUEST, fleet.router_client)))
    rollout.start()
    return rollout, box


def _wait_busy(engine_url: str, rollout: threading.Thread) -> None:
    while rollout.is_alive() and httpx.get(f"{engine_url}/get_load", timeout=5).json()[0]["num_tokens"] == 0:
        time.sleep(0.02)


def _kill_mid_rollout(fleet: Fleet, victims: list[int]) -> tuple[list[Sample], bool, float]:
    """Run REQUEST in a thread, SIGKILL the victims' engine processes once engine victims[0]
    is decoding; returns the samples, whether the rollout was still running at the kill, and
    the kill's time.monotonic()."""
    rollout, box = _start_rollout(fleet)
    _wait_busy(fleet.engine_urls[victims[0]], rollout)
    pids = [ray.get(fleet.actors[i].pid.remote()) for i in victims]  # the engine process the actor launched
    running, killed_at = rollout.is_alive(), time.monotonic()
    for pid in pids:
        os.kill(pid, signal.SIGKILL)
    rollout.join(180)
    assert not rollout.is_alive() and "samples" in box, "rollout did not complete"
    return box["samples"], running, killed_at


def _wait_for(condition: Callable[[], bool], what: str, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s  # a bound against hangs, not a timed assertion
    while not condition():
        assert time.monotonic() < deadline, f"gave up waiting for {what}"
        time.sleep(0.1)


def _assert_restarted(fleet: Fleet, old_pids: list[int], victims: list[int], num_events: int,
                      killed_at: float) -> None:
    _wait_for(lambda: len(fleet.restart_events()) >= num_events, "the restarts")
    fleet.supervisor.wait_all_serving(120)
    pids = fleet.pids()
    listed = {w["url"]: w["is_healthy"] for w in fleet.router.workers()}
    for i in range(2):
        assert (pids[i] != old_pids[i]) == (i in victims)
        assert fleet.clients[i].health_generate()
        assert listed.get(fleet.engine_urls[i]) is True, f"engine {i} not routable: {listed}"
        assert fleet.clients[i].model_info()["weight_version"] == fleet.served[1]  # the served weights
    assert len(listed) == 2  # the dead engines' entries were deleted
    for event in fleet.restart_events()[-len(victims):]:  # measured numbers, logged for the record
        log.warning("restart of engine %d: kill->detected %.2fs, %s", event["engine"],
                    event["died_at"] - killed_at, event)


def test_engine_killed_mid_rollout_is_replaced(fleet) -> None:
    reference = default_rollout(REQUEST, fleet.router_client)
    old_pids = fleet.pids()
    samples, running, killed_at = _kill_mid_rollout(fleet, victims=[0])
    assert running, "the kill must land while the rollout runs"
    grouped = _samples_by_prompt(samples)
    assert sorted(grouped) == [p.index for p in PROMPTS] and all(len(g) == N for g in grouped.values())
    # Nothing lost, nothing duplicated, and the retried requests yielded the very same tokens.
    assert grouped == _samples_by_prompt(reference)
    assert {s.weight_version for s in samples} == {"1"}
    _assert_restarted(fleet, old_pids, victims=[0], num_events=1, killed_at=killed_at)
    rollout, box = _start_rollout(fleet)
    _wait_busy(fleet.engine_urls[0], rollout)  # the router sends the new engine work
    rollout.join(180)
    assert _samples_by_prompt(box["samples"]) == grouped
    # A weight push after the restart reaches the new engine (same weights, next version).
    FleetTransport(fleet, build_transport("disk")).push(fleet.clients, fleet.served[0], "2")
    assert [c.model_info()["weight_version"] for c in fleet.clients] == ["2", "2"]


def test_all_engines_killed_requests_wait_for_successors(fleet) -> None:
    """No peer to reroute to: the router fails the requests and the client retries them,
    whole and with the same seeds, until a restarted engine is routable."""
    reference = _samples_by_prompt(default_rollout(REQUEST, fleet.router_client))
    old_pids, retries = fleet.pids(), fleet.router_client.num_retries
    samples, running, killed_at = _kill_mid_rollout(fleet, victims=[0, 1])
    assert running
    assert _samples_by_prompt(samples) == reference
    assert {s.weight_version for s in samples} == {fleet.served[1]}  # restarted engines reloaded it
    assert fleet.router_client.num_retries > retries
    _assert_restarted(fleet, old_pids, victims=[0, 1], num_events=3, killed_at=killed_at)


@pytest.fixture(scope="module")
def slow_fleet(ray_session, models):
    """Engines whose cold start takes 4 s, checked every 0.5 s with a threshold of 1 failure,
    and no restart budget: a health checker without a grace period would kill them."""
    cfg = _config(max_restarts=0, health_failure_threshold=1)
    f = Fleet.start(models[0], 2, cfg, weight_version="0", load_delay_s=4.0)
    yield f
    f.stop()


def test_warming_engines_are_not_killed(slow_fleet) -> None:
    assert slow_fleet.supervisor.num_restarts == 0 and slow_fleet.restart_events() == []
    # The premise: checks did fail during the warm-up, any one of them fatal past it.
    assert all(s.startup_failures >= 1 for s in slow_fleet.supervisor.slots)
    assert [ray.get(a.pid.remote()) for a in slow_fleet.actors] == slow_fleet.pids()
    slow_fleet.raise_if_failed()
    assert len(default_rollout(REQUEST, slow_fleet.router_client)) == len(PROMPTS) * N


def test_restart_budget_zero_fails_clearly(slow_fleet) -> None:
    victim = slow_fleet.pids()[1]
    os.kill(victim, signal.SIGKILL)
    deadline = time.monotonic() + 120
    with pytest.raises(FleetError) as err:
        while time.monotonic() < deadline:  # the rollout fails once the supervisor has decided
            default_rollout(REQUEST, slow_fleet.router_client)
    message = str(err.value)
    log.warning("the budget-0 error reads:\n%s", message)
    assert "engine 1" in message and f"pid {victim}" in message and "max_engine_restarts=0" in message
    assert f"engine pid {victim} serving" in message  # the last lines of the engine's own log


def test_failed_model_load_fails_fast(ray_session, tmp_path) -> None:
    """A model that cannot load is not 'warming up': the engine is declared dead at once,
    not after rollout.engine_startup_timeout_s (here 90 s)."""
    with pytest.raises(FleetError, match="model load failed"):
        Fleet.start(str(tmp_path), 1, _config(max_restarts=0), weight_version="0")


def test_admin_key_reaches_restarted_engines_and_no_record_or_log(ray_session, models, tmp_path, caplog) -> None:
    """A fleet given the campaign's admin key file: its engines refuse admin calls without
    the key, its own clients push weights and admit a restarted engine (which reloads the
    served weights: an admin call) with it, and the key appears in no fleet document (what
    blocks/*/fleet.json records), no engine or router log and no log record."""
    key = f"fleet-admin-key-{os.getpid()}-{time.monotonic_ns()}"
    key_path = tmp_path / "secrets" / "engine_admin_key"
    key_path.parent.mkdir(mode=0o700)
    key_path.write_text(key)
    key_path.chmod(0o600)
    docs: list[str] = []
    (tmp_path / "logs").mkdir()
    caplog.set_level(logging.DEBUG)
    f = Fleet.start(models[0], 1, _config(max_restarts=1, num_engines=1), weight_version="0",
                    log_dir=str(tmp_path / "logs"), on_change=lambda doc: docs.append(json.dumps(doc)),
                    admin_key_path=str(key_path))
    try:
        FleetTransport(f, build_transport("disk")).push(f.clients, models[1], "1")
        old_url = f.engine_urls[0]
        assert httpx.post(f"{old_url}/pause_generation", json={}, timeout=10).status_code == 401
        os.kill(f.pids()[0], signal.SIGKILL)
        _wait_for(lambda: len(f.restart_events()) >= 1, "the restart")
        f.supervisor.wait_all_serving(120)
        new_url = f.engine_urls[0]
        assert new_url != old_url and f.clients[0].model_info()["weight_version"] == "1"  # admitted with the key
        assert httpx.post(f"{new_url}/update_weight_version", json={"new_version": "x"}, timeout=10).status_code == 401
        assert f.router_client.generate([3, 4, 5], {"max_new_tokens": 2})["meta_info"]["weight_version"] == "1"
        docs.append(json.dumps(f.describe()))
        router_log = f.router.log_path
    finally:
        f.stop()
    files = [p for p in (tmp_path / "logs").rglob("*") if p.is_file()] + [Path(router_log)]
    logs = [p.read_text(errors="replace") for p in files]
    assert len(logs) >= 3  # two engine incarnations and the router
    for text in docs + logs + [caplog.text]:
        assert key not in text and str(key_path) not in text


def test_a_restarted_engine_waits_for_the_served_folder_being_written(ray_session, models, tmp_path) -> None:
    """A `tensor` push's HF export is written behind it, while the next rollout runs
    (core/weight_export.py). An engine restarted meanwhile is admitted only once that folder
    is whole, and loads it; the fleet's record (blocks/*/fleet.json) names the folder only
    then, so a stage killed mid-export never leaves it pointing at a half-written one."""
    release = threading.Event()

    def export(path: str) -> None:  # the trainer's export, held until the engine is waiting for it
        assert release.wait(120)
        shutil.copytree(models[1], path)

    records: list[list[str]] = []
    f = Fleet.start(models[0], 1, _config(max_restarts=1, num_engines=1), weight_version="0",
                    on_change=lambda doc: records.append(doc["served"]))
    exports = WeightExports(tmp_path / "exports", export)
    f.track_exports(exports)
    try:
        with exports.behind(1) as folder, f.weight_push():
            f.record_served(str(folder), "1")  # what a committed push records (FleetTransport.push)
        assert f.served == (str(folder), "1") and records[-1] == [models[0], "0"]
        old_pid = f.pids()[0]
        os.kill(old_pid, signal.SIGKILL)
        _wait_for(lambda: f.supervisor.slots[0].pid != old_pid and "healthy" in f.supervisor.slots[0].timings,
                  "the restarted engine's first healthy answer")
        time.sleep(2.0)  # it would be admitted by now if it did not wait for the folder
        assert f.supervisor.slots[0].state == "starting" and not folder.exists()
        release.set()
        f.supervisor.wait_all_serving(120)
        assert f.clients[0].model_info()["weight_version"] == "1"
        # serving (pushes include it) comes before the router registration; the restart is
        # recorded after that, with its time to routable
        _wait_for(lambda: bool(f.restart_events()), "the restart's record")
        assert f.restart_events()[-1]["weight_version"] == "1"
        assert records[-1] == [str(folder), "1"] and f.describe()["served"] == [str(folder), "1"]
    finally:
        release.set()
        exports.close()
        f.stop()


def _gone(pid: int, timeout_s: float = 30.0) -> bool:
    """True once `pid` is gone (or a zombie waiting for its parent)."""
    import psutil

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                return True
        except psutil.NoSuchProcess:
            return True
        time.sleep(0.2)
    return False


def test_the_engine_process_dies_with_its_actor(ray_session, models, tmp_path) -> None:
    """The actor owns its engine: a killed actor's engine dies (PR_SET_PDEATHSIG), and `stop`
    ends the engine's whole process group (it leads its own: start_new_session)."""
    from milepost.core.fleet.actor import EngineActor
    from milepost.core.fleet.launcher import engine_command

    command = engine_command(RolloutConfig(), models[0], "0", colocated=False, host="127.0.0.1")
    killed, stopped = (EngineActor.remote(str(tmp_path / f"{n}.log")) for n in ("killed", "stopped"))
    pids = [ray.get(a.launch.remote(command), timeout=120)[1] for a in (killed, stopped)]
    assert all(os.getpgid(pid) == pid for pid in pids)  # each leads its own group
    ray.kill(killed, no_restart=True)
    assert _gone(pids[0]), "the engine outlived its killed actor"
    ray.get(stopped.stop.remote(), timeout=60)
    assert _gone(pids[1]) and ray.get(stopped.status.remote())["alive"] is False
    ray.kill(stopped, no_restart=True)
