"""Running tiny-arith campaigns from tests, and reading what they left: shared by the
fault-injection suite (tests/faults) and the driver-kill tests (tests/integration/test_kill_resume.py).

A campaign is run as a user runs it, `python -m milepost.cli run recipes/tiny-arith.yaml
--campaign DIR --set …`, with `MILEPOST_CACHE` pointed at a cache shared by every run of a
session (the tiny model is built once). Everything here reads the campaign store only:
stage records (blocks/N/<stage>.json), fleet.json, metrics.jsonl, `milepost status --json`.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from milepost.core.records import block_path, stage_record_path

ROOT = Path(__file__).resolve().parents[2]
RECIPE = "recipes/tiny-arith.yaml"
# Metric keys that differ between identical runs: wall-clock times and rates measured from them.
NONDETERMINISTIC = ("timing/", "sync/seconds", "sync/send_seconds", "sync/gb_per_s")

# sync: batch-invariant engines, or the final sha would differ from the reference by how the
# engine happened to batch requests (its logprobs feed the trainer); see test_kill_resume.py.
MODES = {"sync": ("loop.max_staleness=0", "rollout.deterministic_inference=true"),
         "async": ("loop.max_staleness=1", "cluster.placement=disaggregated")}
EXECUTORS = {"local": (),
             "slurm": ("cluster.executor=slurm", "cluster.num_nodes=2", "cluster.slurm.time_min=30")}



def option(config, name: str, default=None):
    """A --soak option's value; `default` where this suite's conftest was not loaded at
    start-up (pytest run from a parent folder)."""
    try:
        return config.getoption(name)
    except ValueError:
        return default

@dataclass(frozen=True)
class Shape:
    """How big one campaign is: one epoch of the built-in data set, exactly."""

    num_blocks: int = 1
    steps_per_block: int = 2
    prompts_per_step: int = 4
    samples_per_prompt: int = 4
    checkpoint_every: int = 1
    warmstart_steps: int = 600  # the recipe default: one sample in eight is right, so RL moves the weights
    eval_prompts: int = 4
    extra: tuple[str, ...] = field(default=())

    @property
    def num_steps(self) -> int:
        return self.num_blocks * self.steps_per_block

    @property
    def num_prompts(self) -> int:
        return self.num_steps * self.prompts_per_step

    def overrides(self) -> list[str]:
        return [f"campaign.num_blocks={self.num_blocks}", f"campaign.steps_per_block={self.steps_per_block}",
                f"checkpoint.every_steps={self.checkpoint_every}", f"rollout.prompts_per_step={self.prompts_per_step}",
                f"rollout.num_samples_per_prompt={self.samples_per_prompt}",
                f"model.tiny.warmstart_steps={self.warmstart_steps}", f"eval.num_prompts={self.eval_prompts}",
                f"data.num_train_rows={self.num_prompts}",  # exactly one epoch
                "filters.drop_zero_variance_groups=false", *self.extra]


def command(campaign: Path, overrides: list[str] | tuple[str, ...]) -> list[str]:
    sets = [a for o in overrides for a in ("--set", o)]
    return [sys.executable, "-m", "milepost.cli", "run", RECIPE, "--quiet", "--campaign", str(campaign), *sets]


def env(cache: Path) -> dict[str, str]:
    return {**os.environ, "MILEPOST_CACHE": str(cache)}


def build_model(cache: Path, overrides: list[str]) -> None:
    """Build (or find) the recipe's tiny model in `cache`, so that no timed run pays for it."""
    code = ("import sys; from milepost.core.recipe_io import load_recipe; "
            "from milepost.core.model.loading import resolve_model_path; "
            f"r = load_recipe({RECIPE!r}, sys.argv[1:]); resolve_model_path(r.model, r.seed)")
    subprocess.run([sys.executable, "-c", code, *overrides], cwd=ROOT, check=True, timeout=1200,
                   env=env(cache), capture_output=True)


def start(campaign: Path, cache: Path, overrides: list[str] | tuple[str, ...], log: Path) -> subprocess.Popen:
    """`milepost run` in a session of its own (what is left of it can be found and stopped)."""
    with open(log, "ab") as out:
        return subprocess.Popen(command(campaign, overrides), cwd=ROOT, env=env(cache), stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True)


def run_to_end(campaign: Path, cache: Path, overrides: list[str] | tuple[str, ...], log: Path,
               timeout_s: float = 900) -> int:
    """Run `milepost run` until it exits; its exit status (-9 if it ran past `timeout_s`)."""
    proc = start(campaign, cache, overrides, log)
    try:
        return proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        kill_session(proc)
        return -9


def kill_session(proc: subprocess.Popen) -> None:
    """SIGKILL what is left of a run this test started: its own session's processes."""
    import psutil

    sid = proc.pid  # start_new_session: the session id is the leader's pid
    for p in psutil.process_iter():
        try:
            if os.getsid(p.pid) == sid:
                p.send_signal(signal.SIGKILL)
        except (psutil.Error, ProcessLookupError, PermissionError):
            pass
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        pass


# --- reading the store ------------------------------------------------------------------------
def record(campaign: Path, stage: str, block: int = 0) -> dict[str, Any]:
    path = campaign / stage_record_path(block, stage)
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):  # absent, or being rewritten this instant
        return {}


def fleet_doc(campaign: Path, block: int = 0) -> dict[str, Any]:
    return record(campaign, "fleet", block)


def metrics(campaign: Path) -> list[dict[str, Any]]:
    """Every block's metric rows, in block order."""
    rows = []
    for path in sorted(campaign.glob("blocks/*/metrics.jsonl")):
        try:
            text = path.read_text()
        except OSError:
            continue
        for line in text.splitlines():
            if line.strip():
                try:
                    rows.append(json.loads(line))
                except ValueError:  # a line being written
                    pass
    return rows


def steps_recorded(campaign: Path) -> int:
    return max((r["step"] for r in metrics(campaign)), default=0)


def status(campaign: Path) -> dict[str, Any]:
    out = subprocess.run([sys.executable, "-m", "milepost.cli", "status", str(campaign), "--json"], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    return json.loads(out.stdout) if out.returncode == 0 else {}


def final_state(campaign: Path, num_blocks: int, doc: dict[str, Any] | None = None
                ) -> tuple[str | None, list[dict[str, Any]]]:
    """(latest checkpoint's model_sha256, every metric row without its nondeterministic keys),
    from `milepost status --json` (or its document `doc`, already read)."""
    doc = status(campaign) if doc is None else doc
    rows = []
    for b in range(num_blocks):
        path = campaign / block_path(b, "metrics.jsonl")
        if path.exists():
            rows += [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    for row in rows:
        for key in [k for k in row if k.startswith(NONDETERMINISTIC)]:
            del row[key]
    return (doc.get("latest_checkpoint") or {}).get("model_sha256"), rows


def complete(campaign: Path, num_blocks: int, doc: dict[str, Any] | None = None) -> bool:
    """Every block done, per `milepost status` (its document `doc`, or read in this process:
    the same function, without a process start per poll)."""
    if doc is None:
        from milepost.tasks.status import campaign_status
        try:
            doc = campaign_status(str(campaign))
        except Exception:  # noqa: BLE001 - not a campaign (yet): not complete
            return False
    blocks = doc.get("blocks", [])
    return len(blocks) >= num_blocks and all(b["state"] == "done" for b in blocks[:num_blocks])


def wait_until(condition, proc: subprocess.Popen | None, timeout_s: float, what: str, poll_s: float = 0.05) -> bool:
    """Poll `condition` until true (True), `proc` ended or `timeout_s` passed (False)."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if (proc is not None and proc.poll() is not None) or time.monotonic() > deadline:
            return False
        time.sleep(poll_s)
    return True


def checkpoint_model_shas(campaign: Path) -> dict[int, str]:
    """{step: sha256 of the checkpoint's HF weights file}, from each committed MANIFEST.json."""
    shas = {}
    for manifest in campaign.glob("checkpoints/*/MANIFEST.json"):
        try:
            files = json.loads(manifest.read_text())["files"]
            shas[int(manifest.parent.name)] = files["hf/model.safetensors"]["sha256"]
        except (OSError, ValueError, KeyError):
            pass
    return shas


def first_divergent_step(campaign: Path, reference: Path) -> int | None:
    """The first step whose checkpointed weights differ from the reference's (None: none do)."""
    mine, ref = checkpoint_model_shas(campaign), checkpoint_model_shas(reference)
    return next((s for s in sorted(set(mine) & set(ref)) if mine[s] != ref[s]), None)
