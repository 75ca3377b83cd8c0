"""The campaign lease: one writer at a time, a dead local holder is replaced at once, an
expired one after its expiry, and only the holder renews or releases it."""

from __future__ import annotations

import multiprocessing
import subprocess
import sys
import time
from pathlib import Path

import pytest

from milepost.core.store import CampaignStore
from milepost.tasks import lease


def test_a_second_owner_is_refused_naming_the_holder(tmp_path: Path) -> None:
    store = CampaignStore(str(tmp_path))
    first = lease.acquire(store, "airflow:dag/run_1", ttl_s=60)
    assert lease.read_lease(store)["owner"] == "airflow:dag/run_1"
    with pytest.raises(lease.LeaseHeldError, match=r"being run by airflow:dag/run_1, lease expires in (59|60)s"):
        lease.acquire(store, "airflow:dag/run_2", ttl_s=60)
    again = lease.acquire(store, "airflow:dag/run_1", ttl_s=60)  # the holder renews
    assert again["acquired_at"] == first["acquired_at"] and again["expires_at"] >= first["expires_at"]


def test_an_expired_lease_is_taken_over(tmp_path: Path) -> None:
    store = CampaignStore(str(tmp_path))
    lease.acquire(store, "a", ttl_s=0.2)
    time.sleep(0.3)
    assert lease.acquire(store, "b", ttl_s=60)["owner"] == "b"
    with pytest.raises(lease.LeaseHeldError, match=r"a no longer holds the lease .*\(held by b, lease expires"):
        lease.renew(store, "a")


def test_a_dead_local_holder_is_replaced_at_once(tmp_path: Path) -> None:
    store = CampaignStore(str(tmp_path))
    holder = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        lease.acquire(store, "milepost-run:dead", ttl_s=600, pid=holder.pid)
        with pytest.raises(lease.LeaseHeldError):
            lease.acquire(store, "milepost-run:next", ttl_s=600)  # alive: refused
    finally:
        holder.kill()
        holder.wait()
    assert lease.acquire(store, "milepost-run:next", ttl_s=600)["owner"] == "milepost-run:next"


def test_only_the_holder_releases(tmp_path: Path) -> None:
    store = CampaignStore(str(tmp_path))
    lease.acquire(store, "a")
    assert lease.release(store, "b") is False and lease.read_lease(store)["owner"] == "a"
    assert lease.release(store, "a") is True and lease.read_lease(store) is None
    with pytest.raises(ValueError, match="ttl_s must be > 0"):
        lease.acquire(store, "a", ttl_s=0)


def test_keeper_renews_while_held_and_releases_at_exit(tmp_path: Path) -> None:
    store = CampaignStore(str(tmp_path))
    with lease.LeaseKeeper(store, "keeper", ttl_s=0.6) as keeper:
        first = lease.read_lease(store)["expires_at"]
        time.sleep(1.0)  # past the first expiry: renewed meanwhile, so still refused to others
        assert lease.read_lease(store)["expires_at"] > first
        with pytest.raises(lease.LeaseHeldError):
            lease.acquire(store, "intruder")
        assert keeper.lost is None
    assert lease.read_lease(store) is None


def _race(url: str, owner: str, start: float, results) -> None:
    while time.time() < start:
        time.sleep(0.001)
    try:
        lease.acquire(CampaignStore(url), owner, ttl_s=60)
        results.put(owner)
    except lease.LeaseHeldError:
        results.put(None)


def test_simultaneous_acquisitions_have_exactly_one_winner(tmp_path: Path) -> None:
    ctx = multiprocessing.get_context("fork")
    results = ctx.Queue()
    start = time.time() + 0.5
    procs = [ctx.Process(target=_race, args=(str(tmp_path), f"p{i}", start, results)) for i in range(6)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(30)
    winners = [w for w in (results.get(timeout=5) for _ in procs) if w]
    assert len(winners) == 1 and lease.read_lease(CampaignStore(str(tmp_path)))["owner"] == winners[0]
