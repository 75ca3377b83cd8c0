"""The Ray allocation script's start-up logic, run by real bash with the cluster's commands
faked (srun runs its command here, scontrol names two nodes, `$PYTHON` plays Ray): a worker
node whose step exits while the cluster forms fails the allocation at once, not after the
join timeout; when every node joins, the script holds the allocation with the address
published; once up, it stops itself when its campaign's lease watch says the lease stayed dead,
and keeps holding if the watch itself fails. tests/integration/test_slurm_ray_allocation.py
runs the same script on real Slurm."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from milepost.slurm.options import SlurmOptions
from milepost.slurm.sbatch import RayAllocationSpec, RayPorts, render_ray_allocation

GUARD_S = 60  # against hanging forever; the join timeout below is 600 s

FAKE_SRUN = """#!/bin/bash
while [[ "$1" == --* ]]; do shift; done
exec "$@"
"""
FAKE_SCONTROL = """#!/bin/bash
printf 'n1\\nn2\\n'
"""
# $PYTHON as Ray: the head listens on the GCS port; a worker exits 1 unless WORKER_LIVES is set;
# ray_join publishes the address and exits 0 if JOIN_PUBLISHES is set, else waits (never joins).
FAKE_PYTHON = f"""#!/bin/bash
case "$*" in
  -c*) echo 127.0.0.1 ;;
  *milepost.slurm.port_check*) exit 0 ;;
  *"start --head"*) exec {sys.executable} -c "import os, socket, time
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(('127.0.0.1', int(os.environ['GCS_PORT']))); s.listen(); time.sleep(120)" ;;
  *"start --address"*) [ -n "$WORKER_LIVES" ] && exec sleep 120; exit 1 ;;
  *milepost.slurm.ray_join*)
    if [ -n "$JOIN_PUBLISHES" ]; then sleep 1; echo "127.0.0.1:$GCS_PORT" > "$ADDRESS_FILE_FOR_TEST"; exit 0; fi
    echo $$ > "$JOIN_PID_FILE"; exec sleep 120 ;;
  *milepost.tasks.lease_watch*)
    echo $$ > "$WATCH_PID_FILE"; echo "$*" > "$WATCH_PID_FILE.args"; sleep "$WATCH_SLEEP_S"; exit "$WATCH_RC" ;;
esac
"""


def _free_port_block(size: int) -> int:
    """A base port whose `size` next ports are free now (the fake head binds the first)."""
    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            base = s.getsockname()[1]
        if base + size < 65000:
            return base
    raise RuntimeError("no free port block")


def _allocation(tmp_path: Path, campaign_url: str | None = None,
                watch_armed: bool = False) -> tuple[Path, dict[str, str], Path]:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in (("srun", FAKE_SRUN), ("scontrol", FAKE_SCONTROL), ("python", FAKE_PYTHON)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    base = _free_port_block(10)
    ports = RayPorts(gcs=base, dashboard=base + 1, client_server=base + 2, node_base=base + 10,
                     min_worker=base + 200, max_worker=base + 300)
    address_file = tmp_path / "ray-address"
    spec = RayAllocationSpec(job_name="t", options=SlurmOptions(nodes=2), ports=ports, log_dir=str(tmp_path),
                             address_file=str(address_file), python=str(bin_dir / "python"),
                             ray_temp_root=str(tmp_path), join_timeout_s=600, campaign_url=campaign_url,
                             watch_armed=watch_armed)
    script = tmp_path / "ray.sbatch"
    script.write_text(render_ray_allocation(spec))
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "SLURM_JOB_NODELIST": "n[1-2]",
           "SLURM_JOB_ID": "4242", "ADDRESS_FILE_FOR_TEST": str(address_file),
           "JOIN_PID_FILE": str(tmp_path / "join.pid"), "WATCH_PID_FILE": str(tmp_path / "watch.pid")}
    return script, env, address_file


def _stop(proc: subprocess.Popen) -> None:
    """The script's whole process group (fake head and join included), whatever happened."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


def test_a_worker_that_exits_while_the_cluster_forms_fails_the_allocation_at_once(tmp_path) -> None:
    script, env, address_file = _allocation(tmp_path)
    started = time.monotonic()
    proc = subprocess.Popen(["bash", str(script)], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    try:
        _, err = proc.communicate(timeout=GUARD_S)
    finally:
        _stop(proc)
    took = time.monotonic() - started
    assert proc.returncode == 1, err
    assert "srun step exited before every node joined" in err, err
    assert took < 30, f"waited {took:.0f} s: the join timeout (600 s) is what it must not wait for"
    assert not address_file.exists()
    join_pid = int((tmp_path / "join.pid").read_text())
    for _ in range(50):  # the join wait is stopped with the allocation
        try:
            os.kill(join_pid, 0)
        except ProcessLookupError:
            break
        time.sleep(0.1)
    else:
        pytest.fail(f"the join process {join_pid} outlived the allocation")


def test_when_every_node_joins_the_allocation_holds_with_the_address_published(tmp_path) -> None:
    script, env, address_file = _allocation(tmp_path)
    env = {**env, "WORKER_LIVES": "1", "JOIN_PUBLISHES": "1"}
    proc = subprocess.Popen(["bash", str(script)], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + GUARD_S
        while not address_file.exists() and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.2)
        time.sleep(2)  # past the join: the script must now be holding, not exiting
        assert proc.poll() is None, proc.communicate()[1]
        assert address_file.read_text().strip().startswith("127.0.0.1:")
        os.killpg(proc.pid, signal.SIGTERM)  # as scancel does
        _, err = proc.communicate(timeout=GUARD_S)
    finally:
        _stop(proc)
    assert "Ray node exited" not in err and "before every node joined" not in err, err


def _held_then(tmp_path: Path, watch_sleep_s: float, watch_rc: int,
               watch_armed: bool = False) -> tuple[subprocess.Popen, Path]:
    """A formed two-node allocation that watches a campaign's lease; the fake watch exits
    `watch_rc` after `watch_sleep_s`."""
    script, env, address_file = _allocation(tmp_path, campaign_url=str(tmp_path / "campaign"),
                                            watch_armed=watch_armed)
    env = {**env, "WORKER_LIVES": "1", "JOIN_PUBLISHES": "1", "WATCH_SLEEP_S": str(watch_sleep_s),
           "WATCH_RC": str(watch_rc)}
    proc = subprocess.Popen(["bash", str(script)], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    return proc, address_file


@pytest.mark.parametrize("armed", [False, True])
def test_an_allocation_whose_campaign_lease_stays_dead_stops_itself(tmp_path, armed) -> None:
    proc, address_file = _held_then(tmp_path, watch_sleep_s=3, watch_rc=0, watch_armed=armed)
    try:
        _, err = proc.communicate(timeout=GUARD_S)
    finally:
        _stop(proc)
    assert proc.returncode == 0, err
    assert "lease; stopping the allocation" in err and "stopping this allocation's Ray" in err, err
    assert (tmp_path / "watch.pid").exists(), "the watch never ran"
    assert ("--armed" in (tmp_path / "watch.pid.args").read_text().split()) == armed
    assert not address_file.exists(), "the address must not outlive the cluster"


def test_a_lease_watch_that_fails_is_dropped_and_the_allocation_keeps_holding(tmp_path) -> None:
    proc, address_file = _held_then(tmp_path, watch_sleep_s=1, watch_rc=3)
    try:
        deadline = time.monotonic() + GUARD_S
        while not (tmp_path / "watch.pid").exists() and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.2)
        time.sleep(3)  # past the watch's exit: still holding
        assert proc.poll() is None, proc.communicate()[1]
        assert address_file.exists()
        os.killpg(proc.pid, signal.SIGTERM)  # as scancel does
        _, err = proc.communicate(timeout=GUARD_S)
    finally:
        _stop(proc)
    assert "the lease watch exited with status 3; holding the allocation without it" in err, err
    assert "Ray node exited" not in err, err
