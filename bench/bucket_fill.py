"""The trainer's side of a copied CUDA push: ways to gather separate weight tensors into
bucket buffers, each timed against one device copy of the same bytes, side by side in one run.

Why: on the H100 the trainer's copy of a 3.4 GB, 841-tensor push into its bucket buffers
(wire.pack_into: one concatenation per bucket) took most of a push that a device copy does
in 2.3 ms (bench/results/cuda_ipc_sync_3gb.txt). Rows:
- pack_into: what CudaSender does each push (the views made, then one torch.cat per bucket);
- cat, views kept: the same concatenation with its input views made once (what a kept plan
  could hold);
- copy_ per tensor: one copy call a tensor (a memcpy each, a launch each);
- foreach_copy: one multi-tensor copy per bucket;
- graph of copies: the per-tensor copies captured once in a CUDA graph and replayed.

    python bench/bucket_fill.py [--params-gb 3.4] [--bucket-mb 1024] [--repeats 5] [--out FILE]
"""

from __future__ import annotations

import argparse
import datetime
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from cuda_ipc_sync import buckets, device_copy_s, emit, model_specs

from milepost.core.weight_sync import wire

RESULTS = Path(__file__).parent / "results" / "bucket_fill_gpu.txt"


def timed(fill: Callable[[], None], repeats: int) -> float:
    """Seconds of one fill (best of `repeats`, each synchronised), after one warm-up."""
    fill()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fill()
        torch.cuda.synchronize()
        best = min(best, time.perf_counter() - start)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--params-gb", type=float, default=3.4)
    parser.add_argument("--bucket-mb", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    specs = model_specs(args.params_gb)
    weights = {s["name"]: torch.randn(s["shape"], device="cuda").to(torch.bfloat16) for s in specs}
    plan = buckets(specs, args.bucket_mb << 20)
    flats = [torch.empty(wire.offsets(b)[1], dtype=torch.uint8, device="cuda") for b in plan]
    tensors = [[weights[s["name"]] for s in b] for b in plan]
    views = [[wire.view(flat, off, s) for s, off in zip(b, wire.offsets(b)[0])] for b, flat in zip(plan, flats)]
    wide = [([t.reshape(-1).view(torch.int16) for t in ts], flat.view(torch.int16)) for ts, flat in zip(tensors, flats)]

    def pack_into() -> None:
        for flat, ts in zip(flats, tensors):
            wire.pack_into(flat, ts)

    def cat_kept() -> None:
        for pieces, out in wide:
            torch.cat(pieces, out=out)

    def copy_each() -> None:
        for vs, ts in zip(views, tensors):
            for v, t in zip(vs, ts):
                v.copy_(t)

    def foreach_copy() -> None:
        for vs, ts in zip(views, tensors):
            torch._foreach_copy_(vs, ts)

    graph = torch.cuda.CUDAGraph()
    copy_each()  # warm-up outside the capture
    torch.cuda.synchronize()
    with torch.cuda.graph(graph, capture_error_mode="thread_local"):
        copy_each()

    rows = {"pack_into (as CudaSender, each push)": pack_into, "cat, views kept": cat_kept,
            "copy_ per tensor": copy_each, "foreach_copy per bucket": foreach_copy, "graph of copies": graph.replay}
    nbytes = sum(wire.spec_nbytes(s) for s in specs)
    copy_s = device_copy_s(nbytes)
    lines = [f"# {datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC, {torch.cuda.get_device_name()}, "
             f"torch {torch.__version__}: python bench/bucket_fill.py --params-gb {args.params_gb} "
             f"--bucket-mb {args.bucket_mb} --repeats {args.repeats}",
             f"weights: {len(specs)} separate bf16 tensors, {nbytes / 1e9:.3f} GB, {len(plan)} buckets; "
             f"one device copy of the same bytes: {copy_s * 1e3:.2f} ms"]
    for name, fill in rows.items():
        s = timed(fill, args.repeats)
        lines.append(f"{name}: {s * 1e3:.2f} ms = {nbytes / s / 1e9:.0f} GB/s, vs device copy {copy_s / s:.3f}")
    same = all(torch.equal(v, t) for vs, ts in zip(views, tensors) for v, t in zip(vs, ts))
    lines.append(f"buffers hold the weights after the last fill: {same}")
    emit(lines, args.out)


if __name__ == "__main__":
    main()
