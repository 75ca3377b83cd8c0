"""gpu-arith's warm-start step, eager vs compiled, side by side in one run (issue 18: the
~76 M model warm-started on the GPU in under 2 minutes; eager took 212-238 s for 3000 steps).

Each variant runs core/model/warmstart.warmstart itself (the build's loop: bf16 autocast,
fused AdamW, clipping, the cosine schedule) on a fresh untrained `builtin:gpu-arith` model
and the build's own rows and targets, for `--steps` steps after `--warmup` steps (the compiled
variant's first steps include its compile, reported apart):
- eager b512: today's build;
- compiled b512: `Schedule.compile` (one padded length, forward + backward through torch.compile);
- eager b2048 / compiled b2048: four times the rows a step (a quarter of the steps for the same rows).
Printed per variant: ms/step, rows/s, the projected time of the build's 3000 x 512 rows, the
ratio to eager b512, and the achieved TFLOP/s (6 x parameters x tokens, padding counted).

Usage (GPU): python bench/warmstart_speed.py --out bench/results/warmstart_speed_gpu.txt
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch

from milepost.core.config import GpuArithConfig
from milepost.core.model import gpu_arith, tiny
from milepost.core.model.warmstart import Schedule, warmstart

VARIANTS = {"eager-b512": (512, False), "compiled-b512": (512, True),
            "eager-b2048": (2048, False), "compiled-b2048": (2048, True)}


def run_variant(cfg: GpuArithConfig, batch_size: int, compiled: bool, steps: int, warmup: int) -> dict[str, Any]:
    """Seconds for `warmup` then `steps` more warm-start steps on a fresh model (synced)."""
    torch.manual_seed(0)
    tokenizer = tiny.build_tokenizer()
    model = tiny._dense_model(cfg, tokenizer).float().to("cuda")
    task = gpu_arith.task(cfg)
    rows = task.rows((warmup + steps) * batch_size, 1000, "train")
    targets = task.targets(rows, cfg, 0)
    lengths = [len(r["prompt"]) + len(t) + 1 for r, t in zip(rows, targets)]
    tokens = sum(lengths)
    # what the steps compute: one length for all (compiled), else each batch's longest row
    padded = (len(rows) * max(lengths) if compiled else
              sum(batch_size * max(lengths[i:i + batch_size]) for i in range(0, len(rows), batch_size)))
    times = []
    for count, first in ((warmup, 0), (steps, warmup * batch_size)):
        part = slice(first, first + count * batch_size)
        torch.cuda.synchronize()
        start = time.perf_counter()
        warmstart(model, tokenizer, rows[part], targets[part],
                  Schedule(count, batch_size, cfg.warmstart_lr, 10, compile=compiled))
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    step_s = times[1] / steps
    params = sum(p.numel() for p in model.parameters())
    flop_per_step = 6 * params * padded / (warmup + steps)
    return {"batch_size": batch_size, "compiled": compiled, "warmup_s": times[0], "ms_per_step": 1e3 * step_s,
            "rows_per_s": batch_size / step_s, "build_3000x512_s": 3000 * 512 * step_s / batch_size,
            "tflops": flop_per_step / step_s / 1e12, "padding_fraction": 1 - tokens / padded}


def describe(r: dict[str, Any], base: dict[str, Any], warmup: int) -> str:
    """One variant's line; the ratio to eager-b512 when that ran."""
    line = (f"{r['ms_per_step']:.1f} ms/step, {r['rows_per_s']:.0f} rows/s, 3000x512 rows in "
            f"{r['build_3000x512_s']:.0f} s, {r['tflops']:.1f} TFLOP/s, first {warmup} steps {r['warmup_s']:.1f} s")
    if "rows_per_s" in base:
        line += f", rows/s vs eager-b512 {r['rows_per_s'] / base['rows_per_s']:.2f}x"
    return line


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=60, help="timed steps per variant (b2048: a quarter)")
    ap.add_argument("--warmup", type=int, default=8)
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--out", default="bench/results/warmstart_speed_gpu.txt")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("warmstart_speed: needs a CUDA device (this measures the GPU warm-start)", file=sys.stderr)
        return 2
    cfg = GpuArithConfig()
    out = Path(args.out)
    lines = [f"# {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, {torch.cuda.get_device_name()}: "
             f"python bench/warmstart_speed.py --steps {args.steps}"]
    results: dict[str, Any] = {}
    for name in args.variants.split(","):
        batch_size, compiled = VARIANTS[name]
        steps = max(4, args.steps * 512 // batch_size)
        try:
            results[name] = run_variant(cfg, batch_size, compiled, steps, args.warmup)
        except Exception as err:  # noqa: BLE001  (one variant failing, a compile error, leaves the others')
            results[name] = {"error": f"{type(err).__name__}: {err}"}
        r, base = results[name], results.get("eager-b512", {})
        line = f"{name}: " + (r["error"] if "error" in r else describe(r, base, args.warmup))
        lines.append(line)
        print(line, flush=True)
        out.write_text("\n".join(lines) + "\n")
        out.with_suffix(".json").write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
