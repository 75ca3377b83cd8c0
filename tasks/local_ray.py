"""A block's local Ray head (the embedded default), started and stopped by pid.

The head runs as `ray start --head --block` in a session of its own, so it outlives the
start_ray job and is not hit by signals meant for the driver's process group. Ports come
from the campaign's slot (as on Slurm) and are checked free here, moving to the next slot
when another cluster holds them: two campaigns on one machine never share a port.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psutil

from milepost.core.engine_wire import BUILTIN_ENGINE_MODULE
from milepost.slurm.port_check import taken_ports
from milepost.slurm.sbatch import NUM_NODE_PORTS, RayPorts

NUM_CPUS = 4  # what the embedded default always declared (ray.init(num_cpus=4))
START_TIMEOUT_S = 120


def node_ip() -> str:
    """This host's outgoing IPv4 literal: Ray takes it whatever --node-ip-address says."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect(("10.255.255.255", 1))
        return s.getsockname()[0]


def free_ray_ports(campaign_id: str, num_tries: int = 20) -> RayPorts:
    for attempt in range(num_tries):
        ports = RayPorts.for_campaign(campaign_id if attempt == 0 else f"{campaign_id}#{attempt}")
        single = [ports.gcs, ports.dashboard, ports.client_server,
                  *range(ports.node_base, ports.node_base + NUM_NODE_PORTS)]
        if not taken_ports(single + [ports.min_worker, ports.max_worker]):
            return ports
    raise RuntimeError(f"no free Ray port slot after {num_tries} tries; other Ray clusters hold them")


def local_gpu_count() -> int:
    """NVIDIA GPUs this machine gives the block (CUDA_VISIBLE_DEVICES when set, else what
    `nvidia-smi -L` lists; 0 without a driver): the head declares them, so engines and
    trainer ranks are placed on them (core/placement.py)."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return len([d for d in visible.split(",") if d.strip() and d.strip() != "-1"])
    from milepost.slurm.local import nvidia_smi_gpu_count
    return nvidia_smi_gpu_count()


def head_command(ports: RayPorts, temp_dir: str) -> list[str]:
    k = ports.node_base
    return [sys.executable, "-m", "ray.scripts.scripts", "start", "--head", "--block",
            f"--port={ports.gcs}", f"--dashboard-port={ports.dashboard}", "--include-dashboard=false",
            f"--ray-client-server-port={ports.client_server}", f"--temp-dir={temp_dir}",
            f"--num-cpus={NUM_CPUS}", f"--num-gpus={local_gpu_count()}", f"--min-worker-port={ports.min_worker}",
            f"--max-worker-port={ports.max_worker}", f"--dashboard-agent-listen-port={k}",
            f"--dashboard-agent-grpc-port={k + 1}", f"--metrics-export-port={k + 2}",
            f"--runtime-env-agent-port={k + 3}", "--disable-usage-stats"]


def start_local_head(ports: RayPorts, temp_dir: str, log_path: Path, auth_env: dict[str, str],
                     on_started: Callable[[int, float], object]) -> dict[str, Any]:
    """Start the head with the campaign's Ray auth (`auth_env`, see tasks.ray_auth);
    `on_started(pid, create_time)` records it before anything is awaited.
    Returns {"address", "pids", "pids_created_at", "node_ips"} once the head accepts drivers."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, **auth_env}
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(head_command(ports, temp_dir), stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, env=env, start_new_session=True)
    created = psutil.Process(proc.pid).create_time()
    on_started(proc.pid, created)
    ip = node_ip()
    address = f"{ip}:{ports.gcs}"
    _wait_listening(proc, ip, ports.gcs, log_path)
    from milepost.slurm.ray_join import wait_for_nodes
    wait_for_nodes(address, 1, START_TIMEOUT_S)
    return {"address": address, "pids": [proc.pid], "pids_created_at": [created], "node_ips": [ip]}


def _wait_listening(proc: subprocess.Popen, ip: str, port: int, log_path: Path) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"the local Ray head exited ({proc.returncode}); log {log_path}:\n"
                               f"{log_path.read_text()[-3000:]}")
        try:
            socket.create_connection((ip, port), timeout=1).close()
            return
        except OSError:
            if time.monotonic() > deadline:
                raise RuntimeError(f"the local Ray head did not listen on {ip}:{port} in {START_TIMEOUT_S}s") from None
            time.sleep(0.2)


def start_lease_watch(campaign_url: str, head: dict[str, Any], temp_dir: str, grace_s: float,
                      log_path: Path, armed: bool = False) -> int:
    """The head's dead driver's switch (tasks/lease_watch.py), in a session of its own like
    the head (`armed`: its --armed); returns its pid. Its command line holds `temp_dir`, so
    whatever stops the head's processes (teardown: stop_processes) stops it too."""
    pid, created = head["pids"][0], head["pids_created_at"][0]
    with open(log_path, "ab") as log:
        proc = subprocess.Popen([sys.executable, "-m", "milepost.tasks.lease_watch", "--campaign", campaign_url,
                                 "--grace-s", str(grace_s), "--interval-s", str(min(30.0, grace_s)),
                                 "--head-pid", str(pid), "--head-created", repr(created), "--temp-dir", temp_dir,
                                 *(["--armed"] if armed else [])],
                                stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
    return proc.pid


def owned_process(pid: int, created_at: float | None) -> psutil.Process | None:
    """The process `pid` if it is still the one created at `created_at` (not a reused pid)."""
    try:
        proc = psutil.Process(pid)
        if created_at is not None and abs(proc.create_time() - created_at) > 1.0:
            return None  # the pid was reused by a process that is not ours
        return proc
    except psutil.NoSuchProcess:
        return None


def _is_fleet_process(proc: psutil.Process) -> bool:
    """A guard on a recorded engine/router pid (which may have been reused since): it must
    still look like a Ray worker, an engine process (core/fleet/launcher.py's modules) or a
    router. Found by pid first, this only vetoes."""
    try:
        cmdline = " ".join(proc.cmdline())
    except psutil.Error:
        return False
    return (cmdline.startswith("ray::") or "default_worker.py" in cmdline
            or any(m in cmdline for m in ("sglang_router", "sglang.launch_server", BUILTIN_ENGINE_MODULE)))


def collect(pids: list[tuple[int, float]], temp_dir: str | None, extra_pids: list[int],
            since: float) -> list[psutil.Process]:
    """The head's processes: recorded pids and descendants, processes whose command line
    holds its unique temp dir, and `extra_pids` (engines, router) started after `since`."""
    found: dict[int, psutil.Process] = {}
    roots = [p for p in (owned_process(pid, created) for pid, created in pids) if p]
    if temp_dir:
        for proc in psutil.process_iter(["cmdline"]):
            if temp_dir in " ".join(proc.info["cmdline"] or []):
                roots.append(proc)
    for pid in extra_pids:
        owned = owned_process(pid, None)
        if owned and owned.create_time() >= since - 1.0 and _is_fleet_process(owned):
            roots.append(owned)
    for root in roots:
        found[root.pid] = root
        try:
            found.update({c.pid: c for c in root.children(recursive=True)})
        except psutil.NoSuchProcess:
            pass
    found.pop(os.getpid(), None)
    return list(found.values())


def stop_processes(pids: list[tuple[int, float]], temp_dir: str | None, extra_pids: list[int],
                   since: float, grace_s: float = 5.0) -> list[int]:
    """SIGTERM every process of the head, SIGKILL what is left after `grace_s`."""
    procs = collect(pids, temp_dir, extra_pids, since)
    for proc in procs:
        _signal(proc, signal.SIGTERM)
    _, alive = psutil.wait_procs(procs, timeout=grace_s)
    # Processes forked meanwhile (a worker being started) are caught by a second sweep.
    alive += [p for p in collect(pids, temp_dir, extra_pids, since) if p.pid not in {a.pid for a in alive}]
    for proc in alive:
        _signal(proc, signal.SIGKILL)
    psutil.wait_procs(alive, timeout=grace_s)
    return sorted(p.pid for p in procs)


def _signal(proc: psutil.Process, sig: int) -> None:
    try:
        proc.send_signal(sig)
    except psutil.NoSuchProcess:
        pass
