"""Sync against async RL on one GPU, side by side: gpu-arith's first block, twice.

python bench/async_vs_sync_gpu.py [--out $OUT/async_vs_sync_gpu.txt] [--set key=value ...]

Runs bench/gpu_arith.py (no Airflow, real Ray, stage jobs) on recipes/gpu-arith.yaml's first
block alone (one epoch of 1,280 prompts, 10 steps, no kill), once per mode, sync first (it
builds the model; the second run finds it cached):
- sync: the recipe as shipped, `loop.max_staleness: 0`, `cluster.placement: colocated` (the
  engine gives its memory back while the trainer steps; the push after the step refills it);
- async: `loop.max_staleness: 1`, `cluster.placement: shared`: the engine and the trainer stay
  resident on the one GPU and step s + 1's rollout runs while step s trains.

What async measures here: the overlap of generation and training **on one device**. They share
its SMs and memory bandwidth, so each runs slower while the other runs; on two GPUs
(`disaggregated`) neither would slow the other. Printed per mode, per-step means over steps
2-10 (step 1 has nothing to overlap with; bench/async_vs_sync.py's `summarize`): step_s (the
trainer's wall time a step), rollout_s (the producer's time to generate and score a chunk),
train_s (train + weight sync, without a push's wait for the chunk), wait_s (waiting for
rollout), then the speed-up sync / async in step time and each run_steps stage's wall time.
One round: each mode's figures come from one run on the same warm machine.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from async_vs_sync import overlap_of, summarize

ONE_BLOCK = ["campaign.num_blocks=1", "data.num_train_rows=1280"]
MODES = {"sync": ["loop.max_staleness=0", "cluster.placement=colocated"],
         "async": ["loop.max_staleness=1", "cluster.placement=shared"]}


def run_mode(name: str, out: Path, extra: list[str]) -> dict:
    """One gpu-arith block in `name`'s mode; its gpu_arith.json (under out/name)."""
    folder = out / name
    folder.mkdir(parents=True, exist_ok=True)
    sets = [*ONE_BLOCK, *MODES[name], *extra]
    cmd = [sys.executable, "bench/gpu_arith.py", "--campaign", f"/tmp/async-vs-sync-{name}", "--no-kill",
           *[a for s in sets for a in ("--set", s)]]
    with open(folder / "gpu_arith.log", "w") as log:
        proc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "OUT": str(folder)})
    if proc.returncode != 0:
        raise SystemExit(f"gpu_arith.py failed in mode {name} (exit {proc.returncode}): see {folder}/gpu_arith.log")
    return json.loads((folder / "gpu_arith.json").read_text())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--set", dest="extra", action="append", default=[])
    ap.add_argument("--out", default=str(Path(os.environ.get("OUT", "out")) / "async_vs_sync_gpu.txt"))
    a = ap.parse_args()
    out = Path(a.out).parent
    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    runs = {name: run_mode(name, out, a.extra) for name in MODES}
    device = runs["sync"].get("device", "?")
    lines = [f"# bench/async_vs_sync_gpu.py {' '.join('--set ' + s for s in a.extra)}".rstrip(),
             f"# {started}, {device}; recipes/gpu-arith.yaml with {' '.join(ONE_BLOCK)}, no kill",
             f"{'mode':>6} {'settings':<45} {'step_s':>7} {'rollout_s':>9} {'train_s':>8} {'wait_s':>7} "
             f"{'stale_max':>9} {'regen':>6} {'run_steps_s':>11} {'either_form':>11}"]
    summary = {}
    for name, run in runs.items():
        block = run["blocks"][0]
        s = summary[name] = summarize(block["steps"])
        lines.append(f"{name:>6} {' '.join(MODES[name]):<45} {s['step_s']:7.3f} {s['rollout_s']:9.3f} "
                     f"{s['train_s']:8.3f} {s['wait_s']:7.3f} {s['staleness_max']:9.0f} {s['regenerated']:6.2f} "
                     f"{sum(block['stages_s']['run_steps']):11.1f} {block['eval']['either_form']:11.3f}")
    lines.append(f"speed-up sync / async in step time: {summary['sync']['step_s'] / summary['async']['step_s']:.2f}x; "
                 f"async overlap max(rollout_s, train_s) / step_s: {overlap_of(summary['async']):.2f}")
    lines.append(f"slow-down of each side while the other runs on the GPU: rollout_s async / sync "
                 f"{summary['async']['rollout_s'] / summary['sync']['rollout_s']:.2f}x, train_s "
                 f"{summary['async']['train_s'] / summary['sync']['train_s']:.2f}x")
    text = "\n".join(lines)
    print(text)
    Path(a.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
