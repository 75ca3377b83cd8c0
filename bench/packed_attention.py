"""Packed (THD) attention of one micro-batch, forward + backward, side by side: one SDPA call
per sequence (what the megatron backend did first), SDPA grouped by length, and on a GPU
torch's flash varlen kernel (core/train/megatron/packed_attention.py).

The shape is gpu-arith's: ~230 rows of 9-18 tokens in a 4096-token micro-batch, 12 heads of
64. Times are medians of `--repeats` after two warm-ups, for one layer; a step runs this per
layer, per micro-batch, per pass.

    python bench/packed_attention.py [--device cpu|cuda] [--rows 230] [--repeats 20] [--out FILE]
"""

from __future__ import annotations

import argparse
import datetime
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from cuda_ipc_sync import emit

from milepost.core.train.megatron.packed_attention import (
    grouped_attention,
    length_groups,
    varlen_attention,
    varlen_usable,
)
from tests.unit.test_packed_attention import per_sequence  # the reference the tests hold both paths to

RESULTS = Path(__file__).parent / "results" / "packed_attention.txt"


def timed(fn: Callable[[], torch.Tensor], device: str, repeats: int) -> float:
    def sync() -> None:
        if device == "cuda":
            torch.cuda.synchronize()
    times = []
    for i in range(repeats + 2):
        sync()
        start = time.perf_counter()
        fn().float().sum().backward()
        sync()
        if i >= 2:
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--rows", type=int, default=230)
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args()
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(9, 19, (args.rows,), generator=g).tolist()
    q, k, v = (torch.randn(sum(lengths), 12, 64, generator=g).to(args.device, dtype).requires_grad_()
               for _ in range(3))
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=args.device)
    groups = length_groups(cu)
    rows = {"per sequence (before)": lambda: per_sequence(q, k, v, lengths, None, False),
            "grouped by length": lambda: grouped_attention(q, k, v, groups, None, False)}
    if varlen_usable(q):
        rows["flash varlen"] = lambda: varlen_attention(q, k, v, cu, max(lengths), None)
    name = torch.cuda.get_device_name() if args.device == "cuda" else f"cpu, {torch.get_num_threads()} threads"
    lines = [f"# {datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC, {name}, torch {torch.__version__}: "
             f"python bench/packed_attention.py --device {args.device} --rows {args.rows} --repeats {args.repeats}",
             f"# one layer's attention, forward + backward, {args.rows} rows, {sum(lengths)} tokens, "
             f"{len(groups.lengths)} distinct lengths, 12 heads x 64, {str(dtype).removeprefix('torch.')}; "
             "median of the repeats"]
    base = None
    for label, fn in rows.items():
        seconds = timed(fn, args.device, args.repeats)
        base = base or seconds
        lines.append(f"{label:24s} {seconds * 1e3:9.3f} ms   {base / seconds:6.1f}x the per-sequence loop")
    emit(lines, args.out)


if __name__ == "__main__":
    main()
