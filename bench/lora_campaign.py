"""tiny-arith-lora, SIGKILLed and resumed: does it end bitwise where the uninterrupted run ends,
and how many bytes does each weight push move?

Runs `milepost run recipes/tiny-arith-lora.yaml` as a user does (sync mode, batch-invariant
engines), twice: once uninterrupted, once SIGKILLed (no clean-up) a seeded-random moment after
a seeded-random step and then run again to the end. Prints one JSON line: both final
`model_sha256` (the adapter's), whether every metric row (timings aside) is equal, the kill,
and sync/bytes (the adapter file each engine loads per push) against sync/full_weight_bytes
(the base model's safetensors, what a full-weight push would move).

    python bench/lora_campaign.py --work /tmp/lora-bench [--seed 1] [--steps 6]

With --kill-engine it instead SIGKILLs the engine process once a seeded-random step is
recorded, in a single run: the fleet's supervisor restarts it from the base weights and it
must load the served adapter before serving again (reports the restarts and the largest
engine/trainer logprob gap after the kill; a restarted engine without the adapter would
answer 400 to lora_path, or give base-model logprobs).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "faults"))
import fault_campaign as cp  # noqa: E402  (the campaign runner the fault tests use)

cp.RECIPE = "recipes/tiny-arith-lora.yaml"


def _wait_for_step(proc, campaign: Path, after_step: int, log: Path) -> None:
    deadline = time.monotonic() + 1200
    while cp.steps_recorded(campaign) < after_step:
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"run ended or stalled before step {after_step}; see {log}")
        time.sleep(0.05)


def run_killed(campaign: Path, cache: Path, overrides: list[str], log: Path, after_step: int,
               delay_s: float) -> int:
    """Start a run, SIGKILL its session `delay_s` after step `after_step` is recorded; the steps then."""
    proc = cp.start(campaign, cache, overrides, log)
    _wait_for_step(proc, campaign, after_step, log)
    time.sleep(delay_s)
    proc.send_signal(signal.SIGKILL)  # `milepost run` itself, as test_kill_resume does
    proc.wait(30)
    return cp.steps_recorded(campaign)


def run_engine_killed(work: Path, cache: Path, overrides: list[str], log: Path, after_step: int) -> dict:
    campaign = work / "engine-killed"
    proc = cp.start(campaign, cache, overrides, log)
    _wait_for_step(proc, campaign, after_step, log)
    pid = cp.fleet_doc(campaign)["engines"][0]["pid"]  # an engine this run started
    os.kill(pid, signal.SIGKILL)
    assert proc.wait(1800) == 0, log
    rows = cp.metrics(campaign)
    restarts = cp.record(campaign, "run_steps").get("engine_restarts")
    return {"killed_engine_pid": pid, "after_step": after_step, "steps": len(rows), "engine_restarts": restarts,
            "engine_logprob_diff_max_after_kill": max(r["train/engine_logprob_diff_max"] for r in rows
                                                      if r["step"] > after_step)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--work", required=True, help="an empty folder for the two campaigns and the log")
    ap.add_argument("--seed", type=int, default=1, help="picks the kill's step and delay")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--kill-engine", action="store_true", help="kill the engine instead of `milepost run`")
    a = ap.parse_args()
    work = Path(a.work)
    work.mkdir(parents=True, exist_ok=True)
    cache = Path(os.environ.get("MILEPOST_CACHE", Path.home() / ".cache" / "milepost"))
    shape = cp.Shape(num_blocks=1, steps_per_block=a.steps, prompts_per_step=8, samples_per_prompt=4,
                     checkpoint_every=2, eval_prompts=32)
    overrides = [*shape.overrides(), "rollout.deterministic_inference=true"]
    log = work / "runs.log"
    cp.build_model(cache, overrides)
    if a.kill_engine:
        print(json.dumps(run_engine_killed(work, cache, overrides, log, random.Random(a.seed).randint(1, a.steps - 2))))
        return
    t0 = time.monotonic()
    assert cp.run_to_end(work / "reference", cache, overrides, log, timeout_s=1800) == 0, log
    ref_s = time.monotonic() - t0
    rng = random.Random(a.seed)
    after_step, delay_s = rng.randint(1, a.steps - 1), rng.uniform(0.0, 1.5)
    killed_at = run_killed(work / "killed", cache, overrides, log, after_step, delay_s)
    assert cp.run_to_end(work / "killed", cache, overrides, log, timeout_s=1800) == 0, log
    ref_sha, ref_rows = cp.final_state(work / "reference", 1)
    sha, rows = cp.final_state(work / "killed", 1)
    accuracy = json.loads((work / "reference/blocks/000000/evaluate.json").read_text())["eval"]["accuracy"]
    print(json.dumps({
        "steps": a.steps, "kill": {"after_step": after_step, "delay_s": round(delay_s, 3), "steps_then": killed_at},
        "reference_sha256": ref_sha, "killed_and_resumed_sha256": sha, "bitwise_equal": sha == ref_sha,
        "rows_equal": rows == ref_rows, "num_rows": len(rows),
        "sync_bytes": sorted({r["sync/bytes"] for r in ref_rows}),
        "full_weight_bytes": sorted({r["sync/full_weight_bytes"] for r in ref_rows}),
        "engine_logprob_diff_max": max(r["train/engine_logprob_diff_max"] for r in ref_rows),
        "reference_accuracy": accuracy, "reference_wall_s": round(ref_s, 1)}))


if __name__ == "__main__":
    main()
