"""The Ray-on-Slurm allocation on the real dev cluster: a head and a worker on two nodes,
the address published as an IP literal, and cancelling it stops exactly its own Ray."""

from __future__ import annotations

import asyncio
import ipaddress
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import psutil
import pytest

from milepost.core.store import CampaignStore
from milepost.slurm.options import SlurmOptions
from milepost.slurm.sbatch import RayAllocationSpec, RayPorts, render_ray_allocation
from milepost.slurm.state import Outcome, SlurmStatePoller
from milepost.tasks.local_ray import free_ray_ports
from milepost.tasks.ray_auth import ray_auth_env

GUARD_S = 180  # a guard against hanging forever, not a timing assertion


def free_slot() -> RayPorts:
    """A port slot free on this host now (the dev cluster's nodes share it), as the launchers
    pick one: a slot taken (a listener, or on a busy machine an ephemeral connection or a
    TIME_WAIT socket on one of its ports) makes the allocation exit 75, which the launcher
    answers with the next slot and a test that submits its own script would fail on."""
    return free_ray_ports(f"test-{uuid.uuid4()}")


def campaign_token_env(campaign: Path) -> dict[str, str]:
    """What the launcher exports to an allocation (tasks/ray_cluster.py): the campaign's own
    Ray token, by path. Without it the nodes look for ~/.ray/auth_token, which exists only if
    something earlier in the session happened to create it."""
    return ray_auth_env(CampaignStore(str(campaign)))


def processes_of(job_id: str) -> dict[int, str]:
    """Ray processes of one allocation, found by its own temp dir in their command lines."""
    marker = f"milepost-ray-{job_id}"
    found = {}
    for proc in psutil.process_iter(["pid", "cmdline", "status"]):
        cmdline = " ".join(proc.info["cmdline"] or [])
        if marker in cmdline and proc.info["status"] != psutil.STATUS_ZOMBIE:
            found[proc.info["pid"]] = cmdline
    return found


def alive(pids) -> set[int]:
    out = set()
    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                out.add(pid)
        except psutil.NoSuchProcess:
            pass
    return out


def wait_until(predicate, what: str, job_id: str) -> None:
    deadline = time.monotonic() + GUARD_S
    while not predicate():
        assert time.monotonic() < deadline, f"{what} (job {job_id})"
        time.sleep(0.5)


@pytest.fixture
def ray_temp_root():
    # Short: Ray's unix socket paths under it must stay below 108 bytes.
    root = tempfile.mkdtemp(prefix="mp-ray-", dir="/tmp")
    yield root
    shutil.rmtree(root, ignore_errors=True)


def test_ray_allocation_spans_both_nodes_and_cancel_stops_only_its_ray(dev_cluster, tmp_path, ray_temp_root):
    spec = RayAllocationSpec(
        job_name="mp-ray-test", options=SlurmOptions(nodes=2, time_min=10, mem_gb=1),
        ports=free_slot(), log_dir=str(tmp_path),
        address_file=str(tmp_path / "it's the ray address"), python=sys.executable, join_timeout_s=120,
        ray_temp_root=ray_temp_root, env=campaign_token_env(tmp_path / "campaign"))
    script = tmp_path / "ray.sbatch"
    script.write_text(render_ray_allocation(spec))
    # A bystander that looks like Ray: the allocation must never stop processes by name.
    bystander = subprocess.Popen(["bash", "-c", "exec -a 'raylet gcs_server ray::bystander' sleep 600"])
    job_id = subprocess.run(["sbatch", "--parsable", str(script)], capture_output=True, text=True,
                            check=True).stdout.strip()
    try:
        _check_allocation(spec, job_id)
        assert bystander.poll() is None, "the allocation's cleanup touched a process that was not its own"
    finally:
        bystander.kill()
        bystander.wait()


def _check_allocation(spec: RayAllocationSpec, job_id: str) -> None:
    address_file = Path(spec.address_file)
    poller = SlurmStatePoller(job_id, timeout_s=GUARD_S)
    ray_pids: dict[int, str] = {}
    try:
        wait_until(lambda: address_file.exists() or asyncio.run(poller.poll()).outcome.terminal,
                   "address never published", job_id)
        assert address_file.exists(), Path(spec.log_dir, f"ray-{job_id}.err").read_text()[-3000:]
        host, port = address_file.read_text().rsplit(":", 1)
        ipaddress.ip_address(host)  # an IP literal, not a hostname
        assert int(port) == spec.ports.gcs
        ray_pids = processes_of(job_id)
        names = " ".join(ray_pids.values())
        assert names.count("raylet") >= 2 and "gcs_server" in names, names
    finally:
        subprocess.run(["scancel", job_id], check=True)
    assert asyncio.run(poller.wait()).outcome is Outcome.CANCELLED
    wait_until(lambda: not alive(ray_pids), f"Ray processes left: {alive(ray_pids)}", job_id)
    wait_until(lambda: not address_file.exists(), "address file not removed", job_id)


LEASE_HOLDER = """import os, sys, time
from milepost.core.store import CampaignStore
from milepost.tasks.lease import acquire, local_owner
acquire(CampaignStore(sys.argv[1]), local_owner(), ttl_s=600, pid=os.getpid())
print("held", flush=True)
time.sleep(600)
"""


def test_an_allocation_whose_driver_was_killed_stops_itself_after_the_grace(dev_cluster, tmp_path, ray_temp_root):
    # The driver: a process that holds the campaign's lease, SIGKILLed once the cluster is up
    # (as a killed `milepost run`: no teardown ever comes).
    campaign = tmp_path / "campaign"
    driver = subprocess.Popen([sys.executable, "-c", LEASE_HOLDER, str(campaign)], stdout=subprocess.PIPE, text=True)
    assert driver.stdout is not None and driver.stdout.readline().strip() == "held"
    grace_s = 6
    # armed, as tasks/ray_cluster.py submits it when a live run holds the lease: the watch counts
    # a dead lease from its start. Unarmed, it must first see the live lease in the 12 s before
    # the kill; one CI run under load (12-07) kept the allocation past the 180 s guard, which a
    # watch started late would explain (that log was lost: a timeout now shows it).
    spec = RayAllocationSpec(
        job_name="mp-ray-orphan", options=SlurmOptions(nodes=2, time_min=10, mem_gb=1),
        ports=free_slot(), log_dir=str(tmp_path),
        address_file=str(tmp_path / "ray-address"), python=sys.executable, join_timeout_s=120,
        ray_temp_root=ray_temp_root, campaign_url=str(campaign), orphan_grace_s=grace_s,
        watch_armed=True, env=campaign_token_env(campaign))
    script = tmp_path / "ray.sbatch"
    script.write_text(render_ray_allocation(spec))
    job_id = subprocess.run(["sbatch", "--parsable", str(script)], capture_output=True, text=True,
                            check=True).stdout.strip()
    poller = SlurmStatePoller(job_id, timeout_s=GUARD_S)
    err_log = Path(spec.log_dir, f"ray-{job_id}.err")
    try:
        wait_until(lambda: Path(spec.address_file).exists() or asyncio.run(poller.poll()).outcome.terminal,
                   "address never published", job_id)
        assert Path(spec.address_file).exists(), err_log.read_text()[-3000:]
        ray_pids = processes_of(job_id)
        time.sleep(2 * grace_s)  # the driver lives: the cluster stays
        assert not asyncio.run(poller.poll()).outcome.terminal, err_log.read_text()[-3000:]
        driver.kill()
        driver.wait()
        try:
            state = asyncio.run(poller.wait())
        except TimeoutError as e:
            pytest.fail(f"{e}\nthe allocation's log:\n{err_log.read_text()[-3000:]}")
    finally:
        driver.kill()
        subprocess.run(["scancel", job_id], check=False)
    log = err_log.read_text()
    assert state.outcome is Outcome.DONE, (state, log[-3000:])
    assert "no run holds campaign" in log and "stopping this allocation" in log, log[-3000:]
    wait_until(lambda: not alive(ray_pids), f"Ray processes left: {alive(ray_pids)}", job_id)
    wait_until(lambda: not Path(spec.address_file).exists(), "address file not removed", job_id)
