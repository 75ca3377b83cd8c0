"""Orchestration overhead per block: the time of a block that is not spent inside its stage
jobs, and the time not spent in start_engines/run_steps/evaluate, for each way a block can run:

    direct            BlockDriver.run_block, no Airflow (what `milepost run` did before the DAG)
    embedded          `milepost run`: the DAG through dag.test(), in-process, local jobs
    standalone-local  a real Airflow (`milepost airflow up`), triggered through REST, local jobs
    standalone-slurm  the same Airflow, every stage a job on the dev Slurm cluster

Same recipe and seed, one block of `--steps` steps each, the tiny model built beforehand.
Per block: wall = the block's DAG run (or BlockDriver.run_block call) from start to end; in stages =
the sum of the stage jobs' own run times (their records' started_at → finished_at, teardown
included); overhead = wall − in stages (task scheduling, job submission and start-up,
imports, trigger polling); not RL = wall − (start_engines + run_steps + evaluate).

    python bench/airflow_overhead.py [--modes direct,embedded,standalone-local,standalone-slurm]
                                     [--steps 4] [--out bench/results/airflow_overhead.txt]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from milepost.core.records import Stage

ROOT = Path(__file__).resolve().parents[1]
STAGES = tuple(s.value for s in Stage)
RL = (Stage.START_ENGINES.value, Stage.RUN_STEPS.value, Stage.EVALUATE.value)


def overrides(steps: int) -> list[str]:
    return ["campaign.num_blocks=1", f"campaign.steps_per_block={steps}", "checkpoint.every_steps=2",
            "rollout.prompts_per_step=8", "rollout.num_samples_per_prompt=4", "model.tiny.warmstart_steps=60",
            "eval.num_prompts=32", f"data.num_train_rows={steps * 8}", "filters.drop_zero_variance_groups=false",
            "cluster.slurm.time_min=10"]  # short limits let Slurm backfill the small stage jobs


def stage_seconds(campaign: Path) -> dict[str, float]:
    out = {}
    for stage in STAGES:
        record = json.loads((campaign / "blocks/000000" / f"{stage}.json").read_text())
        out[stage] = float(record["finished_at"]) - float(record["started_at"])
    return out


def latencies(campaign: Path) -> str:
    """From blocks/0/timings.json: job start-up (submitted → stage started) and the wait seen
    by the orchestrator after a stage finished (finished → its task/driver saw it), summed."""
    path = campaign / "blocks/000000/timings.json"
    if not path.exists():
        return ""
    t = json.loads(path.read_text())["stages"].values()
    start = sum(x["started_at"] - x["submitted_at"] for x in t)
    seen = sum(x["returned_at"] - x["finished_at"] for x in t)
    return f"  (job start-up {start:.1f}s, end→seen {seen:.1f}s)"


def summary(mode: str, wall: float, stages: dict[str, float], campaign: Path) -> str:
    inside = sum(stages.values())
    rl = sum(stages[s] for s in RL)
    parts = " ".join(f"{s}={stages[s]:.1f}" for s in STAGES)
    return (f"{mode:<17} wall {wall:6.1f}s  in stages {inside:6.1f}s  overhead {wall - inside:5.1f}s  "
            f"not RL stages {wall - rl:6.1f}s   [{parts}]{latencies(campaign)}")


def run_direct(work: Path, steps: int, env: dict[str, str]) -> str:
    code = ("import os, sys, time; from milepost.core.recipe_io import load_recipe; "
            "from milepost.tasks.campaign import prepare_campaign; "
            "from milepost.tasks.block_driver import BlockDriver; "
            "p = prepare_campaign(load_recipe('recipes/tiny-arith.yaml', sys.argv[2:]), sys.argv[1]); "
            "t = time.time(); BlockDriver(p.store, p.recipe, driver_pid=os.getpid()).run_block(0); "
            "print('WALL', time.time() - t)")
    out = subprocess.run([sys.executable, "-c", code, str(work / "direct"), *overrides(steps)], cwd=ROOT, env=env,
                         capture_output=True, text=True, check=True, timeout=1800).stdout
    wall = float(next(line for line in out.splitlines() if line.startswith("WALL")).split()[1])
    return summary("direct", wall, stage_seconds(work / "direct"), work / "direct")


def run_embedded(work: Path, steps: int, env: dict[str, str]) -> str:
    campaign = work / "embedded"
    sets = [a for o in overrides(steps) for a in ("--set", o)]
    started = time.time()
    subprocess.run([sys.executable, "-m", "milepost.cli", "run", "recipes/tiny-arith.yaml", "--quiet",
                    "--campaign", str(campaign), *sets], cwd=ROOT, env=env, check=True, timeout=1800,
                   capture_output=True)
    total = time.time() - started
    run = json.loads((campaign / "blocks/000000/dag_run.json").read_text())
    line = summary("embedded", run["ended_at"] - run["started_at"], stage_seconds(campaign), campaign)
    return f"{line}\n{'':<17} (whole `milepost run` {total:.1f}s: + validation, Airflow start-up and db migrate)"


def _api(url: str, method: str, path: str, body: dict | None = None) -> dict:
    request = urllib.request.Request(f"{url}/api/v2{path}", method=method, headers={"Content-Type": "application/json"},
                                     data=None if body is None else json.dumps(body).encode())
    with urllib.request.urlopen(request, timeout=30) as r:
        return json.loads(r.read() or b"null")


def run_standalone(url: str, work: Path, steps: int, executor: str) -> str:
    from datetime import datetime

    campaign = work / f"standalone-{executor}"
    conf = {"campaign_url": str(campaign), "block": 0, "overrides": [*overrides(steps), f"cluster.executor={executor}"]}
    run = _api(url, "POST", "/dags/milepost_tiny_arith/dagRuns", {"logical_date": None, "conf": conf})
    path = f"/dags/milepost_tiny_arith/dagRuns/{run['dag_run_id']}"
    deadline = time.monotonic() + 1800
    while (run := _api(url, "GET", path))["state"] not in ("success", "failed"):
        assert time.monotonic() < deadline, f"{path} not done"
        time.sleep(2)
    assert run["state"] == "success", run
    wall = (datetime.fromisoformat(run["end_date"]) - datetime.fromisoformat(run["start_date"])).total_seconds()
    return summary(f"standalone-{executor}", wall, stage_seconds(campaign), campaign)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--modes", default="direct,embedded,standalone-local,standalone-slurm")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--out", default=str(ROOT / "bench/results/airflow_overhead.txt"))
    args = parser.parse_args()
    modes = args.modes.split(",")
    lines = [f"# Orchestration overhead per block (bench/airflow_overhead.py --steps {args.steps}), tiny-arith,",
             "# one block, model built beforehand; wall = the block's DAG run (BlockDriver.run_block call for direct).",
             f"# load average at start: {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores (shared machine)"]
    with tempfile.TemporaryDirectory(prefix="mp-airflow-bench-") as tmp:
        work = Path(tmp)
        env = {**os.environ, "MILEPOST_CACHE": str(work / "cache")}
        build = ("import sys; from milepost.core.recipe_io import load_recipe; "
                 "from milepost.core.model.loading import resolve_model_path; "
                 "r = load_recipe('recipes/tiny-arith.yaml', sys.argv[1:]); resolve_model_path(r.model, r.seed)")
        subprocess.run([sys.executable, "-c", build, *overrides(args.steps)], cwd=ROOT, env=env, check=True,
                       capture_output=True, timeout=900)
        for mode, fn in (("direct", run_direct), ("embedded", run_embedded)):
            if mode in modes:
                lines.append(fn(work, args.steps, env))
                print(lines[-1], flush=True)
        standalone = [m for m in modes if m.startswith("standalone-")]
        if standalone:
            from milepost import airflow_cmd

            state = airflow_cmd.up(work / "airflow", parallelism=4, no_auth=True,
                                   env_extra={"MILEPOST_CACHE": env["MILEPOST_CACHE"]})
            try:
                while True:  # the dag processor's first parse
                    try:
                        _api(state["url"], "PATCH", "/dags/milepost_tiny_arith", {"is_paused": False})
                        break
                    except OSError:
                        time.sleep(2)
                lines.append(f"# standalone healthy after {state['healthy_after_s']}s")
                for mode in standalone:
                    lines.append(run_standalone(state["url"], work, args.steps, mode.split("-", 1)[1]))
                    print(lines[-1], flush=True)
            finally:
                airflow_cmd.down(work / "airflow")
    Path(args.out).write_text("\n".join(lines) + "\n")
    print(f"written to {args.out}")


if __name__ == "__main__":
    main()
