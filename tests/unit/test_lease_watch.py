"""tasks/lease_watch.py: when a Ray allocation decides its campaign's driver is gone.

The rule on a scripted sequence of lease reads (a clock of our own), then the module run as the
allocation runs it, `python -m milepost.tasks.lease_watch`, against a real local store whose
lease this test holds, then gives back."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from milepost.core.store import CampaignStore
from milepost.tasks.lease import acquire, local_owner, release
from milepost.tasks.lease_watch import wait_until_orphaned

LIVE = {"owner": "milepost-run:h:1"}


class Script:
    """`read_live` answers in order (a value, or an exception to raise); the clock advances
    by each sleep."""

    def __init__(self, answers: list[object]) -> None:
        self.answers, self.now, self.reads, self.logs = list(answers), 0.0, 0, []

    def read_live(self) -> dict | None:
        self.reads += 1
        answer = self.answers.pop(0) if self.answers else None
        if isinstance(answer, Exception):
            raise answer
        return answer  # type: ignore[return-value]

    def run(self, grace_s: float) -> float:
        return wait_until_orphaned(self.read_live, grace_s, 10.0, self.logs.append,
                                   clock=lambda: self.now, sleep=self._sleep)

    def _sleep(self, s: float) -> None:
        self.now += s


def test_a_lease_dead_for_the_whole_grace_ends_the_watch() -> None:
    script = Script([LIVE] + [None] * 10)
    assert script.run(grace_s=30.0) == 30.0
    assert script.reads == 5  # live at 0; dead at 10, 20, 30; 30 s on end at the fifth read
    assert len(script.logs) == 1 and "stops in 30 s" in script.logs[0]


def test_a_live_lease_seen_again_restarts_the_clock() -> None:
    script = Script([LIVE, None, None, LIVE, None, None, None, None])
    assert script.run(grace_s=30.0) == 30.0
    assert script.now == 70.0  # dead from 40 s (after the live read at 30 s) to 70 s


def test_a_store_that_cannot_be_read_counts_as_alive() -> None:
    script = Script([LIVE, None, None, OSError("store unreachable"), None, None, None, None])
    script.run(grace_s=30.0)
    assert script.now == 70.0
    assert any("could not be read" in line and "store unreachable" in line for line in script.logs)


def test_an_armed_watch_counts_from_its_start() -> None:
    # a Slurm allocation submitted by a live run that started only after its driver died
    # (it waited in the queue): the lease is dead from the first read, and the watch ends
    script = Script([None] * 10)
    assert wait_until_orphaned(script.read_live, 30.0, 10.0, script.logs.append, clock=lambda: script.now,
                               sleep=script._sleep, armed=True) == 30.0
    assert script.reads == 4


def test_a_cluster_started_without_a_live_lease_is_not_the_watchs_to_stop() -> None:
    # a stage run by hand, a bench: no run ever held the lease, so the watch is never armed
    script = Script([None] * 50)
    guarded = iter([True] * 40 + [False])
    assert wait_until_orphaned(script.read_live, 30.0, 10.0, script.logs.append, clock=lambda: script.now,
                               sleep=script._sleep, still_needed=lambda: next(guarded)) is None
    assert script.now == 400.0 and not script.logs


def _watch(url: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "milepost.tasks.lease_watch", "--campaign", url,
                             "--grace-s", "2", "--interval-s", "0.2"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_the_watch_holds_while_a_run_holds_the_lease_and_ends_once_it_is_given_back(tmp_path) -> None:
    store = CampaignStore(str(tmp_path / "campaign"))
    owner = local_owner()
    acquire(store, owner, ttl_s=600, pid=os.getpid())
    proc = _watch(store.url)
    try:
        time.sleep(4)  # twice the grace: a live lease keeps it waiting
        assert proc.poll() is None, proc.communicate()
        release(store, owner)
        _, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 0, err
    assert "stopping this allocation" in err and store.url in err, err


def test_a_lease_of_a_run_on_another_host_ends_the_watch_once_it_expires(tmp_path) -> None:
    store = CampaignStore(str(tmp_path / "campaign"))
    now = time.time()
    lease = {"owner": "milepost-run:login2:4242", "host": "login2", "pid": 4242, "renewed_at": now,
             "expires_at": now + 3, "ttl_s": 3}  # another host's pid: only the expiry says it is gone
    store.write_json("lease.json", lease)
    proc = _watch(store.url)
    try:
        _, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 0, err
    assert time.time() - now >= 3 + 2, "stopped before the lease expired and the grace passed"


@pytest.mark.parametrize("argv", [[], ["--campaign"]])
def test_the_watch_needs_a_campaign(argv: list[str]) -> None:
    out = subprocess.run([sys.executable, "-m", "milepost.tasks.lease_watch", *argv], capture_output=True, text=True)
    assert out.returncode == 2 and "--campaign" in out.stderr


def test_the_watch_ends_without_acting_once_what_it_guards_is_gone() -> None:
    guarded = [True, True, False]
    script = Script([None] * 10)
    got = wait_until_orphaned(script.read_live, 30.0, 10.0, script.logs.append, clock=lambda: script.now,
                              sleep=script._sleep, still_needed=lambda: guarded.pop(0))
    assert got is None and script.now == 20.0


def test_a_head_pid_needs_its_create_time() -> None:
    out = subprocess.run([sys.executable, "-m", "milepost.tasks.lease_watch", "--campaign", "/tmp/x",
                          "--head-pid", "1"], capture_output=True, text=True)
    assert out.returncode == 2 and "--head-pid and --head-created go together" in out.stderr


def test_the_orphan_grace_defaults_by_executor_and_takes_a_value() -> None:
    from milepost.core.config import ClusterConfig

    assert ClusterConfig().orphan_grace() == 120  # a local lease names its process: seen at once
    assert ClusterConfig(executor="slurm").orphan_grace() == 1800  # an Airflow lease lapses on expiry
    assert ClusterConfig(executor="slurm", orphan_grace_s=60).orphan_grace() == 60
    with pytest.raises(ValueError, match="orphan_grace_s"):
        ClusterConfig(orphan_grace_s=1)
