"""A campaign's stages as local jobs of this process, for drivers that run where Airflow does
not (bench/gpu_arith.py): each stage is submitted and waited on by the block driver
(tasks/block_driver.py, as the DAG's operator and `milepost run` submit theirs), its job's
output copied to a log file of its own. A stage can be SIGKILLed once at a chosen moment
(a watch of the driver's wait: by the pid its stage record names, a process of the stage's
job) and is then run again, as an Airflow retry runs a task whose job died.
"""

from __future__ import annotations

import functools
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil

from milepost.core.checkpoint import CheckpointManager
from milepost.core.records import Stage, StageState, block_path
from milepost.tasks.block_driver import BlockDriver, StageFailed, SubmittedStage
from milepost.tasks.campaign import prepare_campaign
from milepost.tasks.context import FLEET_DOC

ROOT = Path(__file__).resolve().parents[1]
POLL_S = 0.2
# Builds the recipe's model in a process of its own: the driver never holds the GPU.
BUILD = ("import json, sys, time; from milepost.core.recipe_io import load_recipe; "
         "from milepost.core.model.loading import resolve_model_path; from milepost.core.model import tiny; "
         "r = load_recipe(sys.argv[1], sys.argv[2:]); t = time.monotonic(); p = resolve_model_path(r.model, r.seed); "
         "print(json.dumps({'path': p, 'wall_s': time.monotonic() - t, 'report': tiny.build_report(p)}))")


def write_json_atomic(path: Path, doc: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(doc, indent=1, default=str) + "\n")
    tmp.replace(path)


@dataclass
class KillPlan:
    """SIGKILL the run_steps stage of `block` once: after a checkpoint of the block is committed
    and the next step is recorded (so the resumed stage has a step to redo)."""

    block: int
    report: dict[str, Any] = field(default_factory=dict)

    def moment(self, jobs: StageJobs) -> dict[str, int] | None:
        """The checkpoint and the step recorded now, once the moment has come."""
        spb = jobs.recipe.campaign.steps_per_block
        first, last = self.block * spb + 1, (self.block + 1) * spb
        committed = [s for s in jobs.checkpoints.committed_steps() if first <= s < last]
        if not committed:
            return None
        recorded = max((int(r["step"]) for r in jobs.store.read_metrics(self.block)), default=0)
        return {"checkpoint_step": committed[-1], "killed_at_step": recorded} if recorded > committed[-1] else None


class StageJobs:
    def __init__(self, recipe: Any, overrides: list[str], recipe_path: str, campaign: str, logs: Path) -> None:
        self.recipe, self.overrides, self.recipe_path, self.logs = recipe, overrides, recipe_path, logs
        self.store = prepare_campaign(recipe, campaign).store  # as `milepost run` makes it
        self.checkpoints = CheckpointManager(self.store.local_path("checkpoints"), recipe.checkpoint.keep_last)
        self.driver = BlockDriver(self.store, recipe, driver_pid=os.getpid())  # stage jobs die with this process
        logs.mkdir(parents=True, exist_ok=True)

    def build_model(self) -> dict[str, Any]:
        """Build (or find cached) the recipe's model; its path, wall time and build report."""
        done = subprocess.run([sys.executable, "-c", BUILD, self.recipe_path, *self.overrides], cwd=ROOT,
                              capture_output=True, text=True, check=False)
        (self.logs / "build.log").write_text(done.stdout + done.stderr)
        if done.returncode:
            raise RuntimeError(f"the model build failed (exit {done.returncode}); see {self.logs / 'build.log'}")
        return json.loads(done.stdout.strip().splitlines()[-1])

    def run(self, block: int, stage: Stage, kill: KillPlan | None = None) -> list[float]:
        """Run one stage to the end; the wall time of each attempt (two when `kill` struck)."""
        walls = []
        for attempt in range(2 if kill is not None else 1):
            began, jobs = time.monotonic(), []
            plan = kill if attempt == 0 else None
            try:
                self.driver.run_stage(block, stage, watch=functools.partial(self._watch, jobs, plan))
                return walls + [time.monotonic() - began]
            except StageFailed:
                if not (plan and plan.report):  # failed by itself, not by the plan
                    raise
                walls.append(time.monotonic() - began)
            finally:
                self._keep_log(jobs, block, stage, attempt)
        return walls

    def where(self, block: int) -> dict[str, Any]:
        """Where the block ran: each engine's device (its /server_info, kept in the fleet record)
        and the Megatron ranks' (their log line), with the engines' and router's logs copied
        beside the stage logs."""
        logs = Path(self.store.local_path(block_path(block, "logs")))
        if logs.is_dir():
            shutil.copytree(logs, self.logs / f"b{block}", dirs_exist_ok=True)
        fleet_doc = block_path(block, FLEET_DOC)
        fleet = self.store.read_json(fleet_doc) if self.store.exists(fleet_doc) else {}
        ranks = [m for p in sorted(self.logs.glob(f"b{block}-{Stage.RUN_STEPS.value}-*.log"))
                 for m in re.findall(r"megatron: \d+ rank\(s\) on (\[.*?\])", p.read_text(errors="replace"))]
        return {"engine_devices": [e.get("device", "") for e in fleet.get("engines", [])], "trainer_devices": ranks}

    def _log(self, block: int, stage: Stage, attempt: int) -> Path:
        return self.logs / f"b{block}-{stage.value}-{attempt}.log"

    def _keep_log(self, jobs: list[SubmittedStage], block: int, stage: Stage, attempt: int) -> None:
        """The stage job's output (stdout, then stderr) beside the other logs of this run."""
        paths = [p for job in jobs for p in (job.job.stdout_path, job.job.stderr_path) if p.exists()]
        self._log(block, stage, attempt).write_bytes(b"".join(p.read_bytes() for p in paths))

    def _watch(self, jobs: list[SubmittedStage], plan: KillPlan | None, job: SubmittedStage) -> None:
        jobs.append(job)  # for its log, copied whatever happens
        self._kill_when_due(job, plan)

    def _kill_when_due(self, submitted: SubmittedStage, kill: KillPlan | None) -> None:
        """Wait for the plan's moment, then SIGKILL the stage (the pid its running record names,
        a process of this stage's job); returns at once without a plan, or when the job ended first."""
        if kill is None or kill.block != submitted.block:
            return
        while not submitted.job.state().outcome.terminal:
            moment = kill.moment(self)
            record = self.store.stage_record(submitted.block, Stage.RUN_STEPS)
            if moment and record and record.state is StageState.RUNNING and record.pid in _job_pids(submitted):
                os.kill(record.pid, signal.SIGKILL)
                kill.report.update(moment, block=submitted.block, pid=record.pid, at=time.time())
                return
            time.sleep(POLL_S)


def _job_pids(submitted: SubmittedStage) -> set[int]:
    """The processes of a local stage job (its job id is the pid of submitit's controller)."""
    try:
        return {p.pid for p in psutil.Process(int(submitted.job.job_id)).children(recursive=True)}
    except (psutil.NoSuchProcess, ValueError):
        return set()
