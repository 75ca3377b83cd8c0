"""start_ray and teardown: the block's Ray cluster, owned through its records only.

local: a `ray start --head --block` process in a session of its own (it outlives the
start_ray job), on ports of its own, with a temp dir of its own, and beside it a lease watch
(tasks/lease_watch.py) that stops it if the driver is killed and nothing resumes the campaign. The record holds its pid
and temp dir before the head is even started, so teardown finds every process of it: the
recorded pids, their descendants, and processes whose command line holds that unique temp
dir (Ray's own session processes). SIGTERM, then SIGKILL. Never `ray stop` (it stops every
Ray cluster on the machine), never anything by name.

slurm: the allocation rendered by milepost.slurm.sbatch (a head on the first node, a worker
per other node, the address published once every node joined). The record holds the job id
as soon as sbatch answers; teardown is `scancel` of that id (the allocation's trap stops
its own Ray steps, and slurmstepd kills whatever is left of them).

teardown also stops stage jobs that a killed `milepost run` left `running` (by the pid or
Slurm job id in their record), and marks start_ray/start_engines `released`, so the next run
of the block starts them again.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import psutil

from milepost.core.records import BLOCK_STAGES, Stage, StageRecord, StageState
from milepost.tasks.context import StageContext
from milepost.tasks.local_ray import free_ray_ports, start_lease_watch, start_local_head, stop_processes
from milepost.tasks.ray_auth import ray_auth_env

LAUNCH_TIMEOUT_S = 600
# An allocation whose head found a port of its slot taken exits PORTS_TAKEN_EXIT and is
# submitted again on the next slot; any other failure is the user's to see at once (a bad
# partition or account fails the same way on every slot, and each try costs a queue wait).
PORT_SLOT_TRIES = 8


def start_ray(ctx: StageContext) -> dict[str, Any]:
    if ctx.recipe.cluster.executor == "local":
        return _launch_local(ctx)
    return _launch_slurm(ctx)


def _launch_local(ctx: StageContext) -> dict[str, Any]:
    # Short and unique: Ray's unix sockets live under it (108-byte limit), and teardown
    # finds the head's processes by it.
    temp_dir = f"/tmp/mp-ray-{uuid.uuid4().hex[:10]}"
    ports = free_ray_ports(ctx.url)
    launched_at = time.time()
    ctx.update(Stage.START_RAY, mode="local", temp_dir=temp_dir, launched_at=launched_at)
    head = start_local_head(ports, temp_dir, Path(ctx.block_path("logs", "ray-head.log")), ray_auth_env(ctx.store),
                            on_started=lambda pid, created: ctx.update(Stage.START_RAY, pids=[pid],
                                                                       pids_created_at=[created]))
    # stops the head if the driver is killed and nothing resumes the campaign (tasks/lease_watch.py)
    url = ctx.url if "://" in ctx.url else os.path.abspath(ctx.url)  # the watch outlives this cwd's meaning
    watch_pid = start_lease_watch(url, head, temp_dir, ctx.recipe.cluster.orphan_grace(),
                                  Path(ctx.block_path("logs", "lease-watch.log")), armed=_run_holds_lease(ctx))
    return {"mode": "local", "temp_dir": temp_dir, "launched_at": launched_at, **head, "num_nodes": 1,
            "lease_watch_pid": watch_pid}


def _launch_slurm(ctx: StageContext) -> dict[str, Any]:
    """Submit the allocation; if its head found a port of the campaign's slot taken (exit
    PORTS_TAKEN_EXIT), submit again on the next slot, up to PORT_SLOT_TRIES slots. Any
    other failure before every node joined is raised at once with the allocation's log."""
    armed = _run_holds_lease(ctx)  # read once: every slot's allocation belongs to the same run
    for attempt in range(PORT_SLOT_TRIES):
        job_id, address_file = _submit_allocation(ctx, attempt, armed)
        try:
            address = _wait_for_address(job_id, address_file, Path(ctx.block_path("logs")))
            break
        except AllocationFailed as exc:
            if not exc.ports_taken:
                raise
            if attempt == PORT_SLOT_TRIES - 1:
                raise AllocationFailed(f"{exc}\nEvery one of {PORT_SLOT_TRIES} Ray port slots tried had a port "
                                       "taken on its head node: other Ray clusters or services hold them. Stop "
                                       "leftover clusters (`ray stop` on that node) or keep that node out "
                                       "(cluster.slurm.extra: {exclude: NODE}).") from None
    record = ctx.update(Stage.START_RAY, address=address)
    return {"mode": "slurm", "job_id": job_id, "address": address, "num_nodes": ctx.recipe.cluster.num_nodes,
            "node_ips": _node_ips(ctx), "submitted_at": record.outputs["submitted_at"]}


def _submit_allocation(ctx: StageContext, attempt: int, watch_armed: bool) -> tuple[str, Path]:
    from milepost.slurm.sbatch import RayAllocationSpec, RayPorts, render_ray_allocation

    cluster = ctx.recipe.cluster
    log_dir = Path(ctx.block_path("logs"))
    log_dir.mkdir(parents=True, exist_ok=True)
    address_file = Path(ctx.block_path("ray-address"))
    address_file.unlink(missing_ok=True)  # a stale address must never be taken for this cluster's
    slot_id = ctx.url if attempt == 0 else f"{ctx.url}#{attempt}"
    spec = RayAllocationSpec(
        job_name=f"mp-ray-b{ctx.block}", options=cluster.slurm.model_copy(update={"nodes": cluster.num_nodes}),
        ports=RayPorts.for_campaign(slot_id), log_dir=str(log_dir), address_file=str(address_file),
        python=sys.executable, ray_temp_root="/tmp", join_timeout_s=LAUNCH_TIMEOUT_S,
        env=ray_auth_env(ctx.store),  # a token path on the shared store, never the token
        campaign_url=ctx.url, orphan_grace_s=cluster.orphan_grace(), watch_armed=watch_armed)
    script = Path(ctx.block_path("ray.sbatch"))
    script.write_text(render_ray_allocation(spec))
    job_id = subprocess.run(["sbatch", "--parsable", str(script)], capture_output=True, text=True,
                            check=True, timeout=60).stdout.strip().split(";")[0]
    earlier = ctx.record(Stage.START_RAY)
    first = (earlier.outputs.get("submitted_at") if earlier else None) or time.time()
    ctx.update(Stage.START_RAY, mode="slurm", job_id=job_id, submitted_at=first, attempt=attempt)
    return job_id, address_file


def _run_holds_lease(ctx: StageContext) -> bool:
    """Is a live run (a `milepost run`, an Airflow run) behind this launch? Then the cluster's
    lease watch is armed from its start (tasks/lease_watch.py)."""
    from milepost.tasks.status import live_lease

    try:
        return live_lease(ctx.store) is not None
    except Exception:  # noqa: BLE001 - unreadable now: the watch arms at the first live lease it reads
        return False


class AllocationFailed(RuntimeError):
    def __init__(self, message: str, ports_taken: bool = False) -> None:
        super().__init__(message)
        self.ports_taken = ports_taken  # the head's port check failed: another slot may do


def _wait_for_address(job_id: str, address_file: Path, log_dir: Path) -> str:
    from milepost.slurm.state import query_states_blocking

    deadline = time.monotonic() + LAUNCH_TIMEOUT_S
    while not address_file.exists():
        state = query_states_blocking([job_id])[job_id]
        if state.outcome.terminal or time.monotonic() > deadline:
            if not state.outcome.terminal:
                _cancel_slurm_job(job_id, wait=True)
            err = log_dir / f"ray-{job_id}.err"
            tail = err.read_text()[-3000:] if err.exists() else "(no log)"
            raise AllocationFailed(f"Ray allocation {job_id} ended or timed out ({state.slurm_state}) before every "
                                   f"node joined; its log {err}:\n{tail}",
                                   ports_taken=_ports_taken(state.exit_code, tail))
        time.sleep(0.5)
    return address_file.read_text().strip()


def _ports_taken(exit_code: str, log_tail: str) -> bool:
    """Did the allocation end on its head's port check? By sacct's exit code, or (squeue
    gives none) by the check's own line in the allocation's log."""
    from milepost.slurm.port_check import PORTS_TAKEN_EXIT, TAKEN_MESSAGE

    return exit_code.split(":")[0] == str(PORTS_TAKEN_EXIT) or TAKEN_MESSAGE in log_tail


def _node_ips(ctx: StageContext) -> list[str]:
    import ray

    ctx.connect()
    return sorted(n["NodeManagerAddress"] for n in ray.nodes() if n["Alive"])


# --- teardown ---------------------------------------------------------------------------------
def teardown(ctx: StageContext) -> dict[str, Any]:
    """Release what the block's records say it owns; safe to run any number of times."""
    stopped_jobs = _stop_leftover_stages(ctx)
    launch = ctx.record(Stage.START_RAY)
    started = launch.outputs if launch else {}
    released: dict[str, Any] = {}
    if started.get("mode") == "local":
        released["killed_pids"] = _teardown_local(ctx, started)
    elif started.get("mode") == "slurm" and started.get("job_id"):
        released["cancelled_job"] = _cancel_slurm_job(started["job_id"], wait=True)
    # What the next run of the block must start again (the later stages' outputs stand).
    for stage in (Stage.START_RAY, Stage.START_ENGINES):
        record = ctx.record(stage)
        if record and record.state is not StageState.RELEASED:
            ctx.update(stage, state=StageState.RELEASED, released_at=time.time())
    return {**released, "stopped_stages": stopped_jobs}


def _teardown_local(ctx: StageContext, started: Mapping[str, Any]) -> list[int]:
    pids = list(zip(started.get("pids", []), started.get("pids_created_at", [])))
    fleet = ctx.fleet_doc() or {}
    # Engines and the router are descendants of the head; their recorded pids are a second
    # way to find them should the raylet already be gone. Only processes newer than the head.
    since = started.get("launched_at", 0.0)
    extra = [e["pid"] for e in fleet.get("engines", [])] + [(fleet.get("router") or {}).get("pid")]
    killed = stop_processes(pids, started.get("temp_dir"), [p for p in extra if p], since)
    if started.get("temp_dir", "").startswith("/tmp/mp-ray-"):  # ours alone: a fresh name per launch
        shutil.rmtree(started["temp_dir"], ignore_errors=True)
    return killed


def _stop_leftover_stages(ctx: StageContext) -> list[str]:
    """Stage jobs still `running` per their record (a killed driver's): stop them."""
    me = os.environ.get("SLURM_JOB_ID")
    stopped: list[str] = []
    for stage in BLOCK_STAGES:
        record = ctx.record(stage)
        if record is None or record.state is not StageState.RUNNING:
            continue
        _stop_recorded(record, me)
        ctx.update(stage, state=StageState.ABORTED, aborted_at=time.time())
        stopped.append(stage.value)
    return stopped


def _stop_recorded(record: StageRecord, my_slurm_job: str | None) -> None:
    """The stage job a running record names (by its Slurm job id, else its pid), unless it is this job."""
    if record.slurm_job_id and record.slurm_job_id != my_slurm_job:
        _cancel_slurm_job(record.slurm_job_id, wait=True)
    elif not record.slurm_job_id and record.pid and record.pid != os.getpid():
        _kill_recorded(record.pid, record.pid_created_at)


def _kill_recorded(pid: int, created_at: float | None) -> None:
    try:
        proc = psutil.Process(pid)
        if created_at is not None and abs(proc.create_time() - created_at) > 1.0:
            return  # the pid was reused: not ours
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
    except (psutil.NoSuchProcess, psutil.TimeoutExpired):
        pass


def _cancel_slurm_job(job_id: str, wait: bool) -> str:
    """scancel; with `wait`, until the job has left the queue (state COMPLETING ends only
    once slurmstepd has killed every process of the job), at most 120 s."""
    subprocess.run(["scancel", job_id], capture_output=True, timeout=60)
    deadline = time.monotonic() + 120
    while wait and time.monotonic() < deadline:
        queued = subprocess.run(["squeue", "-h", "-j", job_id, "-o", "%T"], capture_output=True, text=True,
                                timeout=60)
        if queued.returncode == 0 and not queued.stdout.strip():
            break
        time.sleep(0.5)
    return job_id
