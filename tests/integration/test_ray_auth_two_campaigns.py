"""One process, two campaigns' Ray clusters, each with its own token (real `ray start`).

Ray caches, per process, the token it loaded first and the auth mode. A process that runs
stages of several campaigns (a test session, a notebook, the embedded block driver) must
present each cluster its own campaign's token: without tasks.ray_auth reloading Ray's
state, the second connection is refused with `InvalidAuthToken` (seen in CI).
"""

from __future__ import annotations

import os
import tempfile
import time
from pathlib import Path

import pytest

from milepost.core.store import CampaignStore
from milepost.slurm.ray_join import wait_for_nodes
from milepost.tasks.local_ray import START_TIMEOUT_S, free_ray_ports, owned_process, start_local_head, stop_processes
from milepost.tasks.ray_auth import campaign_ray_auth, ray_auth_env


@pytest.fixture
def no_user_ray_auth(monkeypatch):
    for name in ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH"):
        monkeypatch.delenv(name, raising=False)


def _head(store: CampaignStore, tmp: Path, started: list[dict]) -> dict:
    ports = free_ray_ports(store.local_path())
    mine: dict = {"temp_dir": tempfile.mkdtemp(prefix="mp-ray-auth-", dir="/tmp"), "pids": []}  # short socket paths
    started.append(mine)  # before the start: a head whose start fails is stopped too
    log = tmp / f"{ports.gcs}.log"
    head = start_local_head(ports, mine["temp_dir"], log, ray_auth_env(store),
                            lambda pid, at: mine["pids"].append((pid, at)))
    return {**head, "log": log}


def test_each_campaign_presents_its_own_token(tmp_path, no_user_ray_auth):
    stores = [CampaignStore(str(tmp_path / name)) for name in ("a", "b")]
    heads: list[dict] = []
    started: list[dict] = []
    since = time.time()
    try:
        for store in stores:
            with campaign_ray_auth(store):  # as run_stage does: start the head, join it
                heads.append(_head(store, tmp_path, started))
        for _ in range(2):  # and again, in the other order of tokens
            for store, head in zip(stores, heads):
                with campaign_ray_auth(store):
                    try:
                        assert wait_for_nodes(head["address"], 1, START_TIMEOUT_S) == 1
                    except TimeoutError as e:
                        pytest.fail(f"{e}\n{_head_state(head)}")
        assert "RAY_AUTH_TOKEN_PATH" not in os.environ
    finally:
        for head in started:
            stop_processes(head["pids"], head["temp_dir"], [], since=since)


def _head_state(head: dict) -> str:
    """Whether the head still runs, and its log's end: what tells a refused token from a
    head that died (CI once saw only Ray's bare "Failed to connect")."""
    alive = [owned_process(pid, at) is not None for pid, at in zip(head["pids"], head["pids_created_at"])]
    tail = head["log"].read_text()[-2000:] if head["log"].exists() else "(no log)"
    return f"head processes alive: {alive}; its log ends:\n{tail}"
