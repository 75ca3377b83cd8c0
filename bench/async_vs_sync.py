"""Sync (max_staleness 0) vs async (max_staleness 1) on the same recipe, side by side.

python bench/async_vs_sync.py [--steps 30] [--rounds 3] [--set key=value ...] [--out bench/results/async_vs_sync.txt]

Each round runs `milepost run` twice, one campaign each, with identical recipes but for
`loop.max_staleness` (the order alternates between rounds), and reads the per-step timings
the loop records:
- step_s: the trainer's wall time per step (waiting for rollout + filter + advantages +
  train + weight sync);
- rollout_s: the producer's time to generate and score the step's chunk;
- train_s: train + weight sync (the trainer's own busy time; a push waiting for the chunk
  the trainer needs next counts as waiting, wait_s);
- regen: share of steps whose chunk a weight push cut mid-generation and that was generated
  again.
Prints each round's mean step times, speed-up sync/async and the async run's overlap
efficiency max(rollout_s, train_s) / step_s (1.0 = rollout fully hidden behind training or
the reverse), then the median over rounds: a shared 2-core machine is noisy, and one pair
alone can be off by 20 %. The first step of each block is left out: it cannot overlap with
anything.

Defaults make rollout and training cost about the same on 2 CPU cores: one trainer rank
(one thread) beside one engine (one thread), so the two can really run at once.
"""

from __future__ import annotations

import argparse
import json
import os
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
    held = lambda r: r.get("timing/push_wait_rollout_s", 0.0)  # noqa: E731 - a push waiting for the next chunk
    train_s = statistics.mean(r["timing/train_s"] + r["timing/weight_sync_s"] - held(r) for r in rows)
    wait_s = statistics.mean(r["timing/wait_rollout_s"] + held(r) for r in rows)
    return {"step_s": mean("timing/step_s"), "rollout_s": mean("timing/rollout_s"), "train_s": train_s,
            "wait_s": wait_s, "staleness_max": max(r["rollout/staleness"] for r in rows),
            "reward_last": rows[-1]["rollout/reward_mean"],
            "regenerated": sum(r["rollout/num_generations"] > 1 for r in rows) / len(rows)}


def run_round(tmp: Path, index: int, steps: int, extra: list[str]) -> dict[int, dict[str, float]]:
    """One sync and one async campaign; the order alternates between rounds so that a slow
    drift of the machine's load does not always favour the same mode."""
    order = (0, 1) if index % 2 == 0 else (1, 0)
    results = {}
    for staleness in order:
        rows, wall = run_campaign(tmp / f"r{index}-k{staleness}", staleness, steps, extra)
        results[staleness] = {**summarize(rows), "wall_s": wall}
    return results


def overlap_of(r: dict[str, float]) -> float:
    return max(r["rollout_s"], r["train_s"]) / r["step_s"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--rounds", type=int, default=3, help="sync/async pairs; the median ratio is reported")
    ap.add_argument("--set", dest="extra", action="append", default=[])
    ap.add_argument("--out", default="bench/results/async_vs_sync.txt")
    a = ap.parse_args()
    load_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="milepost-bench-") as tmp:
        rounds = [run_round(Path(tmp), i, a.steps, a.extra) for i in range(a.rounds)]
    lines = [f"# bench/async_vs_sync.py --steps {a.steps} --rounds {a.rounds} "
             f"{' '.join('--set ' + s for s in a.extra)}",
             f"# recipe: recipes/tiny-arith.yaml with {' '.join(DEFAULTS)}",
             f"# {time.strftime('%Y-%m-%d %H:%M')}, {os.cpu_count()} cores, 1-min load average "
             f"{load_before:.2f} before, {os.getloadavg()[0]:.2f} after",
             f"{'round':>5} {'max_staleness':>13} {'step_s':>8} {'rollout_s':>9} {'train_s':>8} {'wait_s':>7} "
             f"{'stale_max':>9} {'regen':>6} {'wall_s':>7} {'speed-up':>8} {'overlap':>7}"]
    for i, results in enumerate(rounds):
        for k, r in results.items():
            ratio = f"{results[0]['step_s'] / r['step_s']:7.2f}x" if k == 1 else ""
            overlap = f"{overlap_of(r):7.2f}" if k == 1 else ""
            lines.append(f"{i:>5} {k:>13} {r['step_s']:8.3f} {r['rollout_s']:9.3f} {r['train_s']:8.3f} "
                         f"{r['wait_s']:7.3f} {r['staleness_max']:9.0f} {r['regenerated']:6.2f} {r['wall_s']:7.1f} "
                         f"{ratio:>8} {overlap:>7}")
    ratios = [r[0]["step_s"] / r[1]["step_s"] for r in rounds]
    lines.append(f"speed-up sync/async (step time), median of {len(rounds)} rounds: "
                 f"{statistics.median(ratios):.2f}x (min {min(ratios):.2f}x, max {max(ratios):.2f}x)")
    lines.append(f"async overlap efficiency max(rollout_s, train_s) / step_s, median: "
                 f"{statistics.median(overlap_of(r[1]) for r in rounds):.2f}")
    text = "\n".join(lines)
    print(text)
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
