"""Sync (max_staleness 0) vs async (max_staleness 1) on the same recipe, side by side.

python bench/async_vs_sync.py [--steps 30] [--set key=value ...] [--out bench/results/async_vs_sync.txt]

Runs `milepost run` twice, one campaign each, with identical recipes but for
`loop.max_staleness`, and reads the per-step timings the loop records:
- step_s: the trainer's wall time per step (waiting for rollout + filter + advantages +
  train + weight sync);
- rollout_s: the producer's time to generate and score the step's chunk;
- train_s: train + weight sync (the trainer's own busy time);
- regen: share of steps whose chunk a weight push cut mid-generation, so it was generated
  again (pushes pause engines in `abort` mode).
Prints mean step time of each, the speed-up sync/async, and the async run's overlap
efficiency max(rollout_s, train_s) / step_s (1.0 = rollout fully hidden behind training or
the reverse). The first step of each block is left out: it cannot overlap with anything.

Defaults make rollout and training cost about the same on 2 CPU cores: one trainer rank
(one thread) beside one engine (one thread), so the two can really run at once.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

DEFAULTS = ["campaign.num_blocks=1", "train.num_ranks=1", "rollout.prompts_per_step=64",
            "eval.num_prompts=32", "checkpoint.every_steps=1000", "cluster.placement=disaggregated"]


def run_campaign(folder: Path, staleness: int, steps: int, extra: list[str]) -> tuple[list[dict], float]:
    sets = [*DEFAULTS, f"campaign.steps_per_block={steps}", f"loop.max_staleness={staleness}", *extra]
    cmd = [sys.executable, "-m", "milepost.cli", "run", "recipes/tiny-arith.yaml", "--quiet",
           "--campaign", str(folder), *[a for s in sets for a in ("--set", s)]]
    start = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        raise SystemExit(f"milepost run failed (max_staleness={staleness}):\n{proc.stderr[-3000:]}")
    rows = [json.loads(line) for f in sorted(folder.glob("blocks/*/metrics.jsonl"))
            for line in f.read_text().splitlines() if line.strip()]
    return rows, wall


def summarize(rows: list[dict]) -> dict[str, float]:
    rows = rows[1:]  # the first step of the block has nothing to overlap with
    mean = lambda key: statistics.mean(r[key] for r in rows)  # noqa: E731
    train_s = statistics.mean(r["timing/train_s"] + r["timing/weight_sync_s"] for r in rows)
    return {"step_s": mean("timing/step_s"), "rollout_s": mean("timing/rollout_s"), "train_s": train_s,
            "wait_s": mean("timing/wait_rollout_s"), "staleness_max": max(r["rollout/staleness"] for r in rows),
            "reward_last": rows[-1]["rollout/reward_mean"],
            "regenerated": sum(r["rollout/num_generations"] > 1 for r in rows) / len(rows)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--set", dest="extra", action="append", default=[])
    ap.add_argument("--out", default="bench/results/async_vs_sync.txt")
    a = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="milepost-bench-") as tmp:
        results = {}
        for staleness in (0, 1):
            rows, wall = run_campaign(Path(tmp) / f"k{staleness}", staleness, a.steps, a.extra)
            results[staleness] = {**summarize(rows), "wall_s": wall}
    sync, asyn = results[0], results[1]
    lines = [f"# bench/async_vs_sync.py --steps {a.steps} {' '.join('--set ' + s for s in a.extra)}",
             f"# recipe: recipes/tiny-arith.yaml with {' '.join(DEFAULTS)}",
             f"{'max_staleness':>13} {'step_s':>8} {'rollout_s':>9} {'train_s':>8} {'wait_s':>7} {'stale_max':>9} {'regen':>6} {'wall_s':>7}"]
    for k, r in results.items():
        lines.append(f"{k:>13} {r['step_s']:8.3f} {r['rollout_s']:9.3f} {r['train_s']:8.3f} {r['wait_s']:7.3f} "
                     f"{r['staleness_max']:9.0f} {r['regenerated']:6.2f} {r['wall_s']:7.1f}")
    overlap = max(asyn["rollout_s"], asyn["train_s"]) / asyn["step_s"]
    lines.append(f"speed-up sync/async (step time): {sync['step_s'] / asyn['step_s']:.2f}x")
    lines.append(f"async overlap efficiency max(rollout_s, train_s) / step_s: {overlap:.2f}")
    text = "\n".join(lines)
    print(text)
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
