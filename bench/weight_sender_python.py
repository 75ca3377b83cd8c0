"""The trainer's Python time in one tensor-transport push, with no copy: what
WeightSender.to_cuda does per bucket for packed weights besides the GPU, measured on the CPU,
side by side in one run, three ways:
- kept plan (now, core/train/cuda_sender.py): look the bucket's tensors up and check that the
  bucket's kept plan still fits them (addresses, shapes, dtypes); the descriptors are reused;
- planned each push (before): look them up, check they lie back to back, place them, encode
  the JSON descriptor;
- the same with the lookup before that (`dict(named_tensors())` per bucket: one pass over every
  tensor of the model for each bucket).

Why on the CPU: on the lent H100 a packed 3.4 GB push spent 8.6 ms on the trainer's side
(bench/results/cuda_ipc_sync_3gb.txt) against 2.3 ms for a device copy of all its bytes, and
none of that is GPU work. The tensors here are small (the Python cost is per tensor, not per
byte); their count and bucket split are those of that run (841 tensors, 4 buckets).

    python bench/weight_sender_python.py [--params-gb 3.4] [--bucket-mb 1024] [--pushes 20] [--out FILE]
"""

from __future__ import annotations

import argparse
import datetime
import platform
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from cuda_ipc_sync import model_specs

from milepost.core.train.cuda_sender import CudaBucketPlan, packed_placement, signature
from milepost.core.train.weight_sender import WeightSender, pack_parameters
from milepost.core.weight_sync import cuda_buffers, wire

RESULTS = Path(__file__).parent / "results" / "weight_sender_python_cpu.txt"


class _Model(torch.nn.Module):
    """As many bf16 parameters as the real model has, in its order, each 8 x 8 (their bucket
    split is computed from the real shapes)."""

    def __init__(self, names: list[str]) -> None:
        super().__init__()
        for name in names:
            self.register_parameter(name, torch.nn.Parameter(torch.zeros(8, 8, dtype=torch.bfloat16),
                                                             requires_grad=False))


def old_gather(sender: WeightSender, names: list[str]) -> list[tuple[wire.Spec, torch.Tensor]]:
    """The lookup before: every tensor of the model, deduplicated, for each bucket."""
    tensors = dict(sender.named_tensors())
    return [({"name": n, "dtype": wire.dtype_name(tensors[n].dtype), "shape": list(tensors[n].shape)}, tensors[n])
            for n in names]


def one_push(plan: list[list[str]], gather: Callable[[list[str]], list[tuple[wire.Spec, torch.Tensor]]]) -> None:
    """to_cuda's CPU side for packed weights, bucket by bucket (no export: it is made once)."""
    for names in plan:
        in_place = packed_placement(gather(names))
        assert in_place is not None  # packed: read in place
        cuda_buffers.encode_descriptor({"device": "GPU-0"}, in_place[1])


def kept_push(plan: list[list[str]], sender: WeightSender, kept: list[CudaBucketPlan]) -> None:
    """to_cuda's CPU side with each bucket's plan kept (CudaSender.send before the copy)."""
    for names, bucket_plan in zip(plan, kept):
        assert bucket_plan.fits(names, sender._live(names), None)


def best_ms(fn: Callable[[], None], pushes: int) -> float:
    fn()
    times = []
    for _ in range(pushes):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--params-gb", type=float, default=3.4)
    ap.add_argument("--bucket-mb", type=int, default=1024)
    ap.add_argument("--pushes", type=int, default=20)
    ap.add_argument("--out", default=str(RESULTS))
    args = ap.parse_args()
    specs = model_specs(args.params_gb)
    names = [s["name"].replace(".", "_") for s in specs]
    plan, bucket, size = [[]], args.bucket_mb * 2**20, 0  # the real shapes decide the split
    for name, spec in zip(names, specs):
        if plan[-1] and size + wire.spec_nbytes(spec) > bucket:
            plan.append([])
            size = 0
        plan[-1].append(name)
        size += wire.spec_nbytes(spec)
    model = _Model(names)
    pack_parameters(model)
    sender = WeightSender(model)
    kept = []
    for bucket_names in plan:
        pairs = sender._gather(bucket_names)
        flat, placed = packed_placement(pairs)  # type: ignore[misc]  # packed: never None
        kept.append(CudaBucketPlan(tuple(bucket_names), True, flat, placed, signature([t for _, t in pairs])))
    now = best_ms(lambda: kept_push(plan, sender, kept), args.pushes)
    new = best_ms(lambda: one_push(plan, sender._gather), args.pushes)
    old = best_ms(lambda: one_push(plan, lambda ns: old_gather(sender, ns)), args.pushes)
    lines = [f"# {datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC, {platform.processor() or 'cpu'} "
             f"({torch.get_num_threads()} torch threads), torch {torch.__version__}: python "
             f"bench/weight_sender_python.py --params-gb {args.params_gb} --bucket-mb {args.bucket_mb}",
             f"{len(names)} tensors in {len(plan)} buckets, best of {args.pushes} pushes "
             "(the trainer's Python, no copy)",
             f"kept plan: lookup and check (now):             {now:7.2f} ms a push",
             f"planned each push, lookup in the state dict:   {new:7.2f} ms a push",
             f"planned each push, dict(named_tensors()):      {old:7.2f} ms a push",
             f"planned each push / kept plan: {new / now:.2f}x; with the older lookup: {old / now:.2f}x"]
    print("\n".join(lines))
    Path(args.out).write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
