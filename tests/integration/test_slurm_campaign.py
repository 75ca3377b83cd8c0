"""Campaigns on the real dev cluster (2 virtual nodes, `bash slurm/devcluster.sh up`).

1. `milepost run … --set cluster.executor=slurm --set cluster.num_nodes=2` completes; every
   stage is a Slurm job that `sacct` lists; the block's Ray cluster has 2 nodes; the result
   is bitwise the local executor's (sync mode is deterministic). The per-stage timings of
   both runs are printed; with MILEPOST_SLURM_OVERHEAD_OUT=bench/results/slurm_overhead.txt
   (on a quiet machine) they are recorded there.
2. Cancelling a block's allocation stops its Ray processes, engine and router (by pid),
   and leaves another campaign's Ray cluster running.
3. The run_steps stage's job is preempted the way submitit's `_interrupt()` does it (TERM, then
   USR2): it is requeued under the same job id and resumes from its last checkpoint.
4. The node running the run_steps stage is set DOWN mid-block: the block is torn down,
   launched again once the node is back, and finishes from its last checkpoint with every
   step once and the reference's exact weights.
"""

from __future__ import annotations

import ipaddress
import itertools
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from urllib.parse import urlparse

import psutil
import pytest

from milepost.core.records import Stage, stage_record_path

ROOT = Path(__file__).resolve().parents[2]
GUARD_S = 180  # against hanging forever, not a timing assertion
STEPS = 6
OVERRIDES = ["campaign.num_blocks=1", f"campaign.steps_per_block={STEPS}", "checkpoint.every_steps=2",
             "rollout.prompts_per_step=8", "rollout.num_samples_per_prompt=4", "model.tiny.warmstart_steps=200",
             "eval.num_prompts=64", f"data.num_train_rows={STEPS * 8}", "filters.drop_zero_variance_groups=false",
             "cluster.slurm.time_min=30"]
SLURM = ["cluster.executor=slurm", "cluster.num_nodes=2"]
STAGES = tuple(s.value for s in Stage)


def _command(campaign: Path, extra: list[str]) -> list[str]:
    sets = [a for o in (*OVERRIDES, *extra) for a in ("--set", o)]
    return [sys.executable, "-m", "milepost.cli", "run", "recipes/tiny-arith.yaml", "--quiet",
            "--campaign", str(campaign), *sets]


def _run(campaign: Path, cache: Path, extra: list[str], log: Path) -> None:
    with open(log, "ab") as out:
        rc = subprocess.run(_command(campaign, extra), cwd=ROOT, env={**os.environ, "MILEPOST_CACHE": str(cache)},
                            stdout=out, stderr=subprocess.STDOUT, timeout=900).returncode
    assert rc == 0, log.read_text()[-5000:]


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> tuple[Path, Path]:
    """The same block on the local executor: (campaign, model cache)."""
    root = tmp_path_factory.mktemp("reference")
    # Build the tiny model first, so that neither timed run pays for it.
    build = ("import sys; from milepost.core.recipe_io import load_recipe; "
             "from milepost.core.model.loading import resolve_model_path; "
             "r = load_recipe('recipes/tiny-arith.yaml', sys.argv[1:]); resolve_model_path(r.model, r.seed)")
    subprocess.run([sys.executable, "-c", build, *OVERRIDES], cwd=ROOT, check=True, timeout=900,
                   env={**os.environ, "MILEPOST_CACHE": str(root / "cache")}, capture_output=True)
    _run(root / "local", root / "cache", [], root / "runs.log")
    return root / "local", root / "cache"


def _record(campaign: Path, stage: str, block: int = 0) -> dict:
    return json.loads((campaign / stage_record_path(block, stage)).read_text())


def _sacct(job_ids: list[str]) -> dict[str, tuple[str, str]]:
    """{job id: (job name, state)} of whole jobs, waiting until sacct knows them all."""
    deadline = time.monotonic() + GUARD_S
    while True:
        out = subprocess.run(["sacct", "-X", "-n", "-P", "-o", "JobIDRaw,JobName,State", "-j", ",".join(job_ids)],
                             capture_output=True, text=True, check=True).stdout
        rows = {r.split("|")[0]: tuple(r.split("|")[1:3]) for r in out.splitlines() if r}
        if all(j in rows and not rows[j][1].startswith(("PENDING", "RUNNING")) for j in job_ids):
            return rows
        assert time.monotonic() < deadline, f"sacct never listed every job as ended: {rows}"
        time.sleep(1.0)


def _final(campaign: Path) -> tuple[str, float]:
    status = subprocess.run([sys.executable, "-m", "milepost.cli", "status", str(campaign), "--json"],
                            capture_output=True, text=True, check=True, cwd=ROOT)
    doc = json.loads(status.stdout)
    return doc["latest_checkpoint"]["model_sha256"], doc["blocks"][0]["eval"]["accuracy"]


def _overhead_lines(name: str, campaign: Path) -> list[str]:
    """Driver-side timings of one block: from submitting start_ray to the first RL step,
    and the gap between one stage job's end and the next one's start (job start-up,
    Python imports, joining Ray)."""
    stages = json.loads((campaign / "blocks" / "000000" / "timings.json").read_text())["stages"]
    t0 = stages["start_ray"]["submitted_at"]
    first_step = _record(campaign, "run_steps")["first_step_done_at"]
    lines = [f"{name}: submission -> Ray cluster up {stages['start_ray']['finished_at'] - t0:.1f}s, "
             f"-> fleet serving {stages['start_engines']['finished_at'] - t0:.1f}s, "
             f"-> first RL step done {first_step - t0:.1f}s"]
    order = [s for s in STAGES if s in stages]
    for a, b in itertools.pairwise(order):
        gap = stages[b]["started_at"] - stages[a]["finished_at"]
        lines.append(f"  {a:>13} -> {b:<13} {gap:5.1f}s from end to next start; {b} ran "
                     f"{stages[b]['finished_at'] - stages[b]['started_at']:.1f}s")
    return lines


def test_slurm_campaign_matches_local_and_every_stage_is_in_sacct(dev_cluster, reference, tmp_path):
    (local, cache), log, slurm = reference, tmp_path / "runs.log", tmp_path / "slurm"
    _run(slurm, cache, SLURM, log)

    launch = _record(slurm, "start_ray")
    assert launch["mode"] == "slurm" and launch["num_nodes"] == 2 and len(launch["node_ips"]) == 2, launch
    # The dev cluster's nodes are hostnames (NodeHostname=<this host>): whatever binds got IP literals.
    rollout = _record(slurm, "start_engines")
    for url in [rollout["router_url"], *rollout["engine_urls"]]:
        ipaddress.ip_address(urlparse(url).hostname)
    for address in [launch["address"].rsplit(":", 1)[0], *launch["node_ips"]]:
        ipaddress.ip_address(address)
    timings = json.loads((slurm / "blocks/000000/timings.json").read_text())["stages"]
    stage_jobs = {s: t["job_id"] for s, t in timings.items()}
    stage_jobs["teardown"] = _record(slurm, "teardown")["slurm_job_id"]
    rows = _sacct([*stage_jobs.values(), launch["job_id"]])
    for stage, job in stage_jobs.items():
        assert rows[job] == (f"mp-{stage}-b0", "COMPLETED"), (stage, rows)
    assert rows[launch["job_id"]][0] == "mp-ray-b0" and rows[launch["job_id"]][1].startswith("CANCELLED")
    # Each stage job ran where its record says, inside the cluster.
    assert all(_record(slurm, s)["slurm_job_id"] == stage_jobs[s] for s in STAGES)

    assert _final(slurm) == _final(local), "the Slurm run must end bitwise where the local run ends"
    lines = [f"# One block of tiny-arith ({STEPS} steps), measured by tests/integration/test_slurm_campaign.py",
             "# on the 2-node dev cluster (2 cores in all) vs the local executor, same recipe and seed,",
             "# model already built. Driver-side wall times; a gap = job start-up + imports + joining Ray.",
             *_overhead_lines("local", local), *_overhead_lines("slurm", slurm)]
    print("\n".join(lines))
    if out := os.environ.get("MILEPOST_SLURM_OVERHEAD_OUT"):  # a recorded measurement, not every test run
        Path(out).write_text("\n".join(lines) + "\n")


def _alive(pids: list[int]) -> list[int]:
    out = []
    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                out.append(pid)
        except psutil.NoSuchProcess:
            pass
    return out


def _allocation_pids(job_id: str) -> list[int]:
    marker = f"milepost-ray-{job_id}"
    return [p.pid for p in psutil.process_iter(["cmdline"]) if marker in " ".join(p.info["cmdline"] or [])]


def test_cancelling_the_allocation_stops_its_block_and_nothing_else(dev_cluster, tmp_path):
    from milepost.core.recipe_io import load_recipe
    from milepost.tasks.block_driver import BlockDriver
    from milepost.tasks.campaign import prepare_campaign
    from milepost.tasks.stage import run_stage

    os.environ["MILEPOST_CACHE"] = str(tmp_path / "cache")
    mine = prepare_campaign(load_recipe(ROOT / "recipes/tiny-arith.yaml", OVERRIDES + SLURM), str(tmp_path / "a"))
    prepare_campaign(load_recipe(ROOT / "recipes/tiny-arith.yaml", OVERRIDES), str(tmp_path / "b"))
    driver = BlockDriver(mine.store, mine.recipe)
    run_stage(str(tmp_path / "b"), 0, "start_ray")  # another campaign's Ray cluster on this machine
    try:
        driver.run_stage(0, Stage.START_RAY)
        driver.run_stage(0, Stage.START_ENGINES)
        launch = _record(tmp_path / "a", "start_ray")
        fleet = json.loads((tmp_path / "a/blocks/000000/fleet.json").read_text())
        ray_pids = _allocation_pids(launch["job_id"])
        fleet_pids = [e["pid"] for e in fleet["engines"]] + [fleet["router"]["pid"]]
        assert len(ray_pids) > 2 and not set(fleet_pids) - set(_alive(fleet_pids)), (ray_pids, fleet_pids)
        other_pids = _record(tmp_path / "b", "start_ray")["pids"]
        other_tree = [c.pid for p in other_pids for c in [psutil.Process(p), *psutil.Process(p).children(True)]]

        subprocess.run(["scancel", launch["job_id"]], check=True)
        deadline = time.monotonic() + GUARD_S
        while _alive(ray_pids + fleet_pids):
            assert time.monotonic() < deadline, f"left running: {_alive(ray_pids + fleet_pids)}"
            time.sleep(0.5)
        assert _alive(other_tree) == other_tree, "another campaign's Ray processes were touched"
    finally:
        driver.teardown(0)
        run_stage(str(tmp_path / "b"), 0, "teardown")
    assert not _alive(other_tree)


def test_a_taken_port_slot_moves_the_allocation_to_the_next_slot(dev_cluster, tmp_path):
    """The campaign's Ray port slot has a port taken on the head node: the allocation exits
    PORTS_TAKEN_EXIT before starting Ray, and the launcher submits it again on the next
    slot, where it starts; the first allocation's log says why."""
    import socket

    from milepost.core.recipe_io import load_recipe
    from milepost.slurm.port_check import TAKEN_MESSAGE
    from milepost.slurm.sbatch import RayPorts
    from milepost.tasks.block_driver import BlockDriver
    from milepost.tasks.campaign import prepare_campaign

    os.environ["MILEPOST_CACHE"] = str(tmp_path / "cache")
    mine = prepare_campaign(load_recipe(ROOT / "recipes/tiny-arith.yaml", OVERRIDES + SLURM), str(tmp_path / "a"))
    driver = BlockDriver(mine.store, mine.recipe)
    holder = socket.socket()
    holder.bind(("0.0.0.0", RayPorts.for_campaign(mine.store.url).dashboard))  # the dev nodes share this host
    holder.listen()
    try:
        driver.run_stage(0, Stage.START_RAY)
        launch = _record(tmp_path / "a", "start_ray")
        # Slot 0 is held here; a later slot may be held by another process on this host too,
        # and moving past it is the same rule: every allocation before the one that started
        # left a log saying its slot was taken.
        assert launch.get("attempt", 0) >= 1, launch
        earlier_logs = [p for p in (tmp_path / "a/blocks/000000/logs").glob("ray-*.err")
                        if p.name != f"ray-{launch['job_id']}.err"]
        assert len(earlier_logs) == launch["attempt"], (launch, earlier_logs)
        assert all(TAKEN_MESSAGE in p.read_text() for p in earlier_logs), [p.read_text()[-500:] for p in earlier_logs]
    finally:
        holder.close()
        driver.teardown(0)


def _metrics(campaign: Path) -> list[dict]:
    path = campaign / "blocks/000000/metrics.jsonl"
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()] if path.exists() else []


def _steps_job_node(campaign: Path, min_step: int, proc: subprocess.Popen, log: Path) -> tuple[str, str]:
    """Wait until the run_steps stage runs as a Slurm job and step `min_step` is recorded."""
    deadline = time.monotonic() + 600
    while True:
        assert proc.poll() is None, log.read_text()[-5000:]
        assert time.monotonic() < deadline, f"run_steps never reached step {min_step}"
        path = campaign / stage_record_path(0, "run_steps")
        steps = json.loads(path.read_text()) if path.exists() else {}
        if steps.get("state") == "running" and len(_metrics(campaign)) >= min_step:
            job = steps["slurm_job_id"]
            node = subprocess.run(["squeue", "-h", "-j", job, "-o", "%N"], capture_output=True, text=True).stdout
            if node.strip():
                return job, node.strip()
        time.sleep(0.2)


@pytest.mark.extended  # CI: test_preempted_run_steps_job… below loses that job mid-block the same way
def test_node_down_mid_block_resumes_from_the_last_checkpoint(dev_cluster, reference, tmp_path):
    (local, cache), log, campaign = reference, tmp_path / "runs.log", tmp_path / "slurm"
    with open(log, "ab") as out:
        proc = subprocess.Popen(_command(campaign, SLURM + ["cluster.max_block_retries=2"]), cwd=ROOT,
                                env={**os.environ, "MILEPOST_CACHE": str(cache)}, stdout=out, stderr=subprocess.STDOUT)
    node = None
    try:
        _, node = _steps_job_node(campaign, 3, proc, log)  # step 2's checkpoint is committed
        subprocess.run(["scontrol", "update", f"nodename={node}", "state=down", "reason=milepost-test"], check=True)
        time.sleep(10)
        subprocess.run(["scontrol", "update", f"nodename={node}", "state=resume"], check=True)
        node = None
        assert proc.wait(900) == 0, log.read_text()[-5000:]
    finally:
        if node:
            subprocess.run(["scontrol", "update", f"nodename={node}", "state=resume"])
        if proc.poll() is None:
            proc.kill()
    assert "launching it again" in log.read_text(), "the block was never relaunched: the node loss went unseen"
    rows = _metrics(campaign)
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    prompts = [i for r in rows for i in r["data/prompt_indices"]]
    assert len(set(prompts)) == len(prompts) == STEPS * 8, "a prompt was lost or trained on twice"
    assert _final(campaign) == _final(local), "resumed after the node loss, the block must end bitwise as the reference"


def test_preempted_run_steps_job_is_requeued_and_resumes_from_its_checkpoint(dev_cluster, reference, tmp_path):
    (local, cache), log, campaign = reference, tmp_path / "runs.log", tmp_path / "slurm"
    with open(log, "ab") as out:
        proc = subprocess.Popen(_command(campaign, SLURM), cwd=ROOT, env={**os.environ, "MILEPOST_CACHE": str(cache)},
                                stdout=out, stderr=subprocess.STDOUT)
    try:
        job, _ = _steps_job_node(campaign, 3, proc, log)  # step 2's checkpoint is committed
        # submitit's SlurmJob._interrupt(): what Slurm sends on preemption
        subprocess.run(["scancel", job, "--signal", "SIGTERM"], check=True)
        subprocess.run(["scancel", job, "--signal", "USR2"], check=True)
        assert proc.wait(900) == 0, log.read_text()[-5000:]
    finally:
        if proc.poll() is None:
            proc.kill()
    rows = subprocess.run(["sacct", "-X", "-n", "-P", "--duplicates", "-o", "JobIDRaw,State", "-j", job],
                          capture_output=True, text=True, check=True).stdout.split()
    assert f"{job}|REQUEUED" in rows and f"{job}|COMPLETED" in rows, rows
    assert _record(campaign, "run_steps")["slurm_job_id"] == job, "the same job must have resumed, not a new one"
    assert "launching it again" not in log.read_text(), "preemption must requeue the stage, not relaunch the block"
    metrics = _metrics(campaign)
    assert [r["step"] for r in metrics] == list(range(1, STEPS + 1))
    prompts = [i for r in metrics for i in r["data/prompt_indices"]]
    assert len(set(prompts)) == len(prompts) == STEPS * 8, "a prompt was lost or trained on twice"
    assert _final(campaign) == _final(local), "resumed after preemption, the block must end bitwise as the reference"
