"""Fault kinds, kill moments, and one fault-injection run from start to verdict.

A run: start `milepost run` on a fresh campaign; at a seeded-random moment (an anchor in
the block's life, read from the store, plus a random delay) SIGKILL one process the
campaign owns, found from the campaign's own records; let the run end; rerun `milepost
run` (bounded) until the campaign is complete; then check that every prompt of the epoch
was trained exactly once, that steps and metric rows have no gap or duplicate, and (sync)
that the final `model_sha256` equals an uninterrupted reference run's.

Victims are found by pid only, from the records: the driver is the process this test
started; a trainer rank, the Ray head's gcs_server/raylet and the head itself are in the
process tree of the pid that `blocks/N/start_ray.json` records; engines and the router by
the pids of `blocks/N/fleet.json` (during the start_engines stage's launch, before fleet.json,
engine actors are found in that tree); a Slurm stage job by the `slurm_job_id` or `pid` of
its running stage record. Nothing is ever killed by name.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import fault_campaign as cp
import psutil

from milepost.core.data.epoch import epoch_coverage
from milepost.core.records import BLOCK_STAGES, Stage, block_path

KINDS = ("driver", "trainer", "engine", "router", "ray_head", "slurm_stage")
MAX_RERUNS = 3          # `milepost run` again after the faulted one, at most
RUN_TIMEOUT_S = 900     # one `milepost run`: against hangs, not a timed assertion
ANCHOR_TIMEOUT_S = 1500  # waiting for the kill moment (a loaded 2-core machine took > 600 s to reach evaluate)
VICTIM_TIMEOUT_S = 60   # waiting for the victim to exist once the moment came
MAX_DELAY_S = 2.0


def executor_of(kind: str) -> str:
    return "slurm" if kind == "slurm_stage" else "local"


# --- moments ----------------------------------------------------------------------------------
def anchors(kind: str, shape: cp.Shape, mode: str = "sync") -> list[str]:
    """Where in block 0's life a fault of `kind` may land. `step:k`: the run_steps stage runs and
    k steps of the block are recorded (the kill hits step k+1 or its checkpoint);
    `start_engines:engines`: the start_engines stage is launching its engines (actors exist,
    fleet.json does not yet); a stage name: that stage's record says running."""
    steps = [f"step:{k}" for k in range(shape.steps_per_block)]
    return {
        "driver": ["start_ray", "start_engines:engines", "start_engines", *steps, "publish", "evaluate"],
        # async: the last steps come in a burst (rollouts were ahead), the stage may end first
        "trainer": steps if mode == "sync" else steps[:-1] or steps,
        "engine": [*steps, "evaluate"],
        "router": [*steps, "evaluate"],
        "ray_head": ["start_engines", *steps, "evaluate"],
        "slurm_stage": ["start_engines", *steps, "evaluate"],
    }[kind]


def victims_of(kind: str) -> list[str]:
    """Variants of a kind, one chosen per run."""
    return {"ray_head": ["gcs_server", "raylet", "head_tree"], "slurm_stage": ["scancel", "pid"]}.get(kind, [kind])


@dataclass
class Plan:
    kind: str
    mode: str
    seed: int
    anchor: str
    delay_s: float
    variant: str

    @property
    def executor(self) -> str:
        return executor_of(self.kind)

    @property
    def name(self) -> str:
        return f"{self.kind}-{self.mode}-{self.seed}"


def plan(kind: str, mode: str, seed: int, shape: cp.Shape, anchor: str | None = None) -> Plan:
    rng = random.Random(f"{kind}/{mode}/{seed}")
    chosen = anchor or rng.choice(anchors(kind, shape, mode))
    # A step lasts a few seconds: within one, the delay moves the kill across its phases.
    delay = rng.uniform(0.0, MAX_DELAY_S / 2 if chosen.startswith("step:") else MAX_DELAY_S)
    return Plan(kind, mode, seed, chosen, round(delay, 2), rng.choice(victims_of(kind)))


def _block_steps(campaign: Path, block: int, shape: cp.Shape) -> int:
    first = block * shape.steps_per_block + 1
    return sum(1 for r in cp.metrics(campaign) if r["step"] >= first)


def anchor_reached(campaign: Path, anchor: str, shape: cp.Shape, block: int = 0) -> bool:
    what, _, arg = anchor.partition(":")
    if what == "step":
        return cp.record(campaign, "run_steps", block).get("state") == "running" and \
            _block_steps(campaign, block, shape) >= int(arg)
    if cp.record(campaign, what, block).get("state") != "running":
        return False
    if arg == "engines":
        return not (campaign / block_path(block, "fleet.json")).exists() and \
            bool(ray_workers(campaign, "ray::EngineActor", block))
    return True


# --- victims ----------------------------------------------------------------------------------
def _owned(pid: int, created_at: float | None) -> psutil.Process | None:
    try:
        proc = psutil.Process(pid)
        if created_at is not None and abs(proc.create_time() - created_at) > 1.0:
            return None
        return proc if proc.status() != psutil.STATUS_ZOMBIE else None
    except psutil.Error:
        return None


def head_tree(campaign: Path, block: int = 0) -> list[psutil.Process]:
    """The block's Ray head process(es) and their descendants, from start_ray.json (local:
    its pids; Slurm: the allocation's processes, whose command lines hold its job's temp dir)."""
    launch = cp.record(campaign, "start_ray", block)
    roots: list[psutil.Process] = []
    if launch.get("mode") == "local":
        for pid, created in zip(launch.get("pids", []), launch.get("pids_created_at", [])):
            if (p := _owned(pid, created)) is not None:
                roots.append(p)
    elif launch.get("job_id"):
        marker = f"milepost-ray-{launch['job_id']}"
        for p in psutil.process_iter(["cmdline"]):
            if marker in " ".join(p.info["cmdline"] or []):
                roots.append(p)
    found: dict[int, psutil.Process] = {}
    for root in roots:
        found[root.pid] = root
        try:
            found.update({c.pid: c for c in root.children(recursive=True)})
        except psutil.Error:
            pass
    return list(found.values())


def _title(proc: psutil.Process) -> str:
    try:
        return " ".join(proc.cmdline())
    except psutil.Error:
        return ""


def ray_workers(campaign: Path, title: str, block: int = 0) -> list[psutil.Process]:
    """Ray worker processes of the block's cluster running an actor of `title` (Ray sets a
    worker's process title to `ray::<Actor>[.<method>]`)."""
    return [p for p in head_tree(campaign, block) if _title(p).startswith(title)]


def find_victims(p: Plan, campaign: Path, driver: subprocess.Popen, block: int = 0) -> tuple[list[int], str]:
    """(pids to SIGKILL, or job ids for scancel as negative sentinels never; a description);
    empty when the victim does not exist (yet)."""
    if p.kind == "driver":
        return [driver.pid], f"milepost run pid {driver.pid}"
    if p.kind == "trainer":
        ranks = sorted(ray_workers(campaign, "ray::RankWorker", block), key=lambda q: q.pid)
        if len(ranks) < 1:
            return [], ""
        victim = ranks[random.Random(p.seed).randrange(len(ranks))]
        return [victim.pid], f"trainer rank process {victim.pid} ({_title(victim)[:40]})"
    if p.kind in ("engine", "router"):
        doc = cp.fleet_doc(campaign, block)
        if p.kind == "engine":
            engines = doc.get("engines", [])
            pids = [e["pid"] for e in engines if _owned(e["pid"], None)]
            return (pids[:1], f"engine pid {pids[0]}") if pids else ([], "")
        pid = (doc.get("router") or {}).get("pid")
        return ([pid], f"sglang-router pid {pid}") if pid and _owned(pid, None) else ([], "")
    if p.kind == "ray_head":
        tree = head_tree(campaign, block)
        if p.variant == "head_tree":
            launch = cp.record(campaign, "start_ray", block)
            return ([q.pid for q in tree], f"ray start --head {launch.get('pids')} and its {len(tree) - 1} "
                    "descendants") if tree else ([], "")
        procs = [q for q in tree if q.name() == p.variant]
        return ([procs[0].pid], f"{p.variant} pid {procs[0].pid}") if procs else ([], "")
    raise ValueError(p.kind)


def _running_stage(campaign: Path, block: int = 0) -> tuple[str, dict[str, Any]] | None:
    for stage in BLOCK_STAGES:
        rec = cp.record(campaign, stage, block)
        if rec.get("state") == "running" and rec.get("slurm_job_id"):
            return stage, rec
    return None


def inject(p: Plan, campaign: Path, driver: subprocess.Popen) -> str:
    """Kill the plan's victim now (waiting up to VICTIM_TIMEOUT_S for it to exist); what was killed."""
    deadline = time.monotonic() + VICTIM_TIMEOUT_S
    while time.monotonic() < deadline:
        if p.kind == "slurm_stage":
            running = _running_stage(campaign)
            if running:
                stage, rec = running
                if p.variant == "scancel":
                    subprocess.run(["scancel", "--signal=KILL", "--full", rec["slurm_job_id"]], check=True,
                                   capture_output=True, timeout=60)
                    return f"scancel --signal=KILL --full job {rec['slurm_job_id']} ({stage} stage)"
                if _owned(rec["pid"], rec.get("pid_created_at")):
                    os.kill(rec["pid"], signal.SIGKILL)
                    return f"SIGKILL stage pid {rec['pid']} (job {rec['slurm_job_id']}, {stage} stage)"
        else:
            pids, what = find_victims(p, campaign, driver)
            if pids:
                for pid in pids:
                    try:
                        os.kill(pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
                return what
        if driver.poll() is not None:
            break
        time.sleep(0.05)
    return ""


# --- one run ----------------------------------------------------------------------------------
@dataclass
class Result:
    kind: str
    mode: str
    seed: int
    executor: str
    anchor: str
    delay_s: float
    variant: str
    killed: str = ""            # what was SIGKILLed ("" if the moment never came)
    killed_at_step: int = -1    # steps recorded at the kill
    stage_at_kill: str = ""
    runs: int = 0               # `milepost run` invocations, the faulted one included
    exit_codes: list[int] = field(default_factory=list)
    resumed: bool = False       # the campaign ended complete
    lost: int = 0               # prompts of the epoch never trained
    repeated: int = 0           # extra trainings of a prompt
    steps_ok: bool = False      # steps 1..N, each once, one metric row each
    sha_equal: bool | None = None  # sync only
    wall_s: float = 0.0
    leftover: int = 0           # processes of the campaign still alive after the last run
    problem: str = ""
    campaign: str = ""
    log: str = ""

    @property
    def ok(self) -> bool:
        return (self.resumed and self.lost == 0 and self.repeated == 0 and self.steps_ok
                and self.sha_equal is not False and bool(self.killed) and not self.problem)

    def row(self) -> dict[str, Any]:
        return {**asdict(self), "ok": self.ok}


def _stage_now(campaign: Path, block: int = 0) -> str:
    for stage in Stage:
        if cp.record(campaign, stage, block).get("state") == "running":
            return stage.value
    return ""


def verify(result: Result, campaign: Path, shape: cp.Shape, reference_sha: str | None) -> None:
    doc = cp.status(campaign)
    sha, rows = cp.final_state(campaign, shape.num_blocks, doc)
    coverage = epoch_coverage(rows, shape.num_steps, shape.num_prompts)
    result.steps_ok, result.lost, result.repeated = coverage.steps_ok, coverage.lost, coverage.repeated
    result.resumed = cp.complete(campaign, shape.num_blocks, doc)
    if result.mode == "sync":
        result.sha_equal = sha is not None and sha == reference_sha
    if not result.steps_ok and not result.problem:
        result.problem = f"steps recorded {list(coverage.steps)}"
    stale = max((r.get("rollout/staleness", 0) for r in rows), default=0)
    if stale > (1 if result.mode == "async" else 0) and not result.problem:
        result.problem = f"a step trained samples {stale} policy versions old"


def leftovers(campaign: Path, shape: cp.Shape) -> list[psutil.Process]:
    """Processes the campaign's records still name (its Ray heads and their trees, fleet pids)."""
    procs: dict[int, psutil.Process] = {}
    for b in range(shape.num_blocks):
        procs.update({q.pid: q for q in head_tree(campaign, b)})
        doc = cp.fleet_doc(campaign, b)
        for pid in [e["pid"] for e in doc.get("engines", [])] + [(doc.get("router") or {}).get("pid")]:
            if pid and (q := _owned(pid, None)) and q.create_time() >= cp.record(campaign, "start_ray", b).get(
                    "launched_at", 0) - 1:
                procs[q.pid] = q
    return list(procs.values())


def release(campaign: Path, shape: cp.Shape, cache: Path) -> None:
    """Run the teardown stage of every block a failed run may have left launched."""
    for b in range(shape.num_blocks):
        launch = cp.record(campaign, "start_ray", b)
        if launch and launch.get("state") != "released":
            subprocess.run([sys.executable, "-m", "milepost.tasks.stage", "--campaign", str(campaign), "--block",
                            str(b), "--stage", "teardown"], cwd=cp.ROOT, env=cp.env(cache), capture_output=True,
                           timeout=300)


def run_fault(p: Plan, root: Path, cache: Path, shape: cp.Shape, reference_sha: str | None,
              on_event: Callable[[str], None] = lambda s: None) -> Result:
    campaign, log = root / p.name, root / f"{p.name}.log"
    overrides = [*shape.overrides(), *cp.MODES[p.mode], *cp.EXECUTORS[p.executor]]
    result = Result(p.kind, p.mode, p.seed, p.executor, p.anchor, p.delay_s, p.variant,
                    campaign=str(campaign), log=str(log))
    started = time.monotonic()
    driver = cp.start(campaign, cache, overrides, log)
    result.runs = 1
    try:
        if cp.wait_until(lambda: anchor_reached(campaign, p.anchor, shape), driver, ANCHOR_TIMEOUT_S, p.anchor):
            time.sleep(p.delay_s)
            result.stage_at_kill, result.killed_at_step = _stage_now(campaign), cp.steps_recorded(campaign)
            result.killed = inject(p, campaign, driver)
            on_event(f"{p.name}: killed {result.killed or 'nothing'} at {p.anchor}+{p.delay_s}s "
                     f"(stage {result.stage_at_kill}, step {result.killed_at_step})")
        if not result.killed:
            result.problem = f"the moment {p.anchor} never came (run ended rc={driver.poll()})"
        try:
            rc = driver.wait(RUN_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            cp.kill_session(driver)
            rc = -9
            result.problem = f"the faulted run hung past {RUN_TIMEOUT_S}s"
        result.exit_codes.append(rc)
        cp.kill_session(driver)  # a SIGKILLed driver's children die on their own; make sure
        while not cp.complete(campaign, shape.num_blocks) and result.runs <= MAX_RERUNS:
            result.runs += 1
            on_event(f"{p.name}: rerun {result.runs - 1}")
            rc = cp.run_to_end(campaign, cache, overrides, log, RUN_TIMEOUT_S)
            result.exit_codes.append(rc)
            if rc == -9 and not result.problem:
                result.problem = f"rerun {result.runs - 1} hung past {RUN_TIMEOUT_S}s"
        verify(result, campaign, shape, reference_sha)
    except Exception as e:  # noqa: BLE001 - a broken run is a result, not the end of the soak
        result.problem = result.problem or f"{type(e).__name__}: {e}"
    finally:
        result.wall_s = round(time.monotonic() - started, 1)
        cp.kill_session(driver)
        left = leftovers(campaign, shape)
        result.leftover = len(left)
        if left:
            release(campaign, shape, cache)
    return result


def reference(root: Path, cache: Path, shape: cp.Shape, mode: str, executor: str) -> str:
    """The uninterrupted run's final model_sha256 (computed once: kept under `root`)."""
    campaign, log = root / f"reference-{mode}-{executor}", root / f"reference-{mode}-{executor}.log"
    overrides = [*shape.overrides(), *cp.MODES[mode], *cp.EXECUTORS[executor]]
    for attempt in range(2):  # a run that failed for want of CPU is not what this suite tests
        if cp.complete(campaign, shape.num_blocks):
            break
        if campaign.exists():
            import shutil
            release(campaign, shape, cache)
            shutil.rmtree(campaign)
        rc = cp.run_to_end(campaign, cache, overrides, log, RUN_TIMEOUT_S)
        assert rc == 0 or attempt == 0, f"reference run failed (rc {rc}): {log}\n{log.read_text()[-3000:]}"
    sha, rows = cp.final_state(campaign, shape.num_blocks)
    assert sha and [r["step"] for r in rows] == list(range(1, shape.num_steps + 1)), (sha, log)
    return sha


def write_results(results: list[Result], path: Path, csv_path: Path, header: str) -> None:
    """RESULTS.md: per (fault, mode) counts, then the total line last; per-run rows in a CSV."""
    import csv

    cells: dict[tuple[str, str], list[Result]] = {}
    for r in results:
        cells.setdefault((r.kind, r.mode), []).append(r)
    lines = [header, "",
             "| fault | mode | executor | runs | resumed | lost | repeated | sha equal (sync) | failed checks |",
             "| --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    order = {k: i for i, k in enumerate(KINDS)}
    for (kind, mode), rs in sorted(cells.items(), key=lambda kv: (order.get(kv[0][0], 99), kv[0][1])):
        shas = [r.sha_equal for r in rs if r.sha_equal is not None]
        lines.append(f"| {kind} | {mode} | {rs[0].executor} | {len(rs)} | {sum(r.resumed for r in rs)} | "
                     f"{sum(r.lost for r in rs)} | {sum(r.repeated for r in rs)} | "
                     f"{f'{sum(shas)}/{len(shas)}' if shas else '-'} | {sum(not r.ok for r in rs)} |")
    bad = [r for r in results if not r.ok]
    if bad:
        lines += ["", "Runs that failed a check (for a sha mismatch: the first step whose checkpointed weights"
                  " differ from the reference's, and the steps recorded when the kill came):", ""]
        lines += [f"- {r.kind}/{r.mode} seed {r.seed} at {r.anchor}+{r.delay_s}s: killed {r.killed or 'nothing'}; "
                  f"resumed {r.resumed}, lost {r.lost}, repeated {r.repeated}, steps ok {r.steps_ok}, "
                  f"sha equal {r.sha_equal}{_divergence(r)}; {r.problem} (log {r.log})" for r in bad]
    lines += ["", f"Per-run rows (seed, kill moment, what was killed, wall time): `{csv_path.name}`.", "",
              f"total: {len(results)} runs, {sum(r.resumed for r in results)} resumed, "
              f"{sum(r.lost for r in results)} lost, {sum(r.repeated for r in results)} repeated"]
    path.write_text("\n".join(lines) + "\n")
    keys = ["kind", "mode", "executor", "seed", "anchor", "delay_s", "variant", "killed", "stage_at_kill",
            "killed_at_step", "runs", "exit_codes", "resumed", "lost", "repeated", "steps_ok", "sha_equal", "wall_s",
            "leftover", "ok", "problem", "log"]
    with open(csv_path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=keys, extrasaction="ignore")
        w.writeheader()
        for r in results:
            row = r.row()
            row["exit_codes"] = " ".join(map(str, r.exit_codes))
            w.writerow(row)


def _divergence(r: Result) -> str:
    if r.sha_equal is not False or not r.log.endswith(".log"):
        return ""
    campaign = Path(r.log[:-len(".log")])
    step = cp.first_divergent_step(campaign, campaign.parent / f"reference-{r.mode}-{r.executor}")
    return f" (weights first differ at step {step}; kill after {r.killed_at_step} step(s) recorded)"


def load_results(csv_path: Path) -> list[Result]:
    """The runs a CSV written by write_results holds (to continue an interrupted soak)."""
    import csv

    def value(name: str, text: str) -> Any:
        kind = Result.__dataclass_fields__[name].type
        if name == "exit_codes":
            return [int(x) for x in text.split()]
        if kind in ("bool", "bool | None"):
            return None if text == "" else text == "True"
        if kind in ("int", "float"):
            return (int if kind == "int" else float)(text)
        return text
    if not csv_path.exists():
        return []
    with open(csv_path) as f:
        return [Result(**{k: value(k, v) for k, v in row.items() if k in Result.__dataclass_fields__})
                for row in csv.DictReader(f)]


def dumps(result: Result) -> str:
    return json.dumps(result.row())
