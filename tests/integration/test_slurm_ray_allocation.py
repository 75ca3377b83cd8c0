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

from milepost.slurm.options import SlurmOptions
from milepost.slurm.sbatch import RayAllocationSpec, RayPorts, render_ray_allocation
from milepost.slurm.state import Outcome, SlurmStatePoller

GUARD_S = 180  # a guard against hanging forever, not a timing assertion


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
        ports=RayPorts.for_campaign(f"test-{uuid.uuid4()}"), log_dir=str(tmp_path),
        address_file=str(tmp_path / "it's the ray address"), python=sys.executable, join_timeout_s=120,
        ray_temp_root=ray_temp_root)
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
