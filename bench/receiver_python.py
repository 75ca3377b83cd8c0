"""The engine's Python time in one colocated push of milepost's CUDA format, measured on the
CPU, side by side in one run, two ways:
- in place (now, core/engine/staging.py): weights a memory resume left unloaded are received
  straight into the live tensors; a bucket is planned as one span copy and the session records
  its names;
- into shadows (before): the same push staged into private shadow tensors, planned tensor by
  tensor, and copied into the live weights at the commit.

Each push is what colocated placement makes: the weights are released and resumed first
(drop_weights, allocate_weights: untimed), then begin, every bucket through the real route
function (weight_routes.load_tensor_payload) and cuda_staging, the version, the commit.

Why on the CPU: on the lent H100 the load of a released 3.4 GB push took 6.3–8.6 ms
(bench/results/cuda_ipc_sync_3gb.txt) against 2.2 ms for a device copy of its bytes, and the
planning is Python, not GPU work. The tensors here are small (the cost is per tensor, not per
byte); their count and bucket split are those of that run (841 tensors, 4 buckets). The
trainer's storage is "mapped" by hand (CUDA IPC needs a GPU), as in tests/unit/test_cuda_staging.py.

    python bench/receiver_python.py [--pushes 20] [--out FILE]
"""

from __future__ import annotations

import argparse
import base64
import datetime
import platform
import statistics
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from cuda_ipc_sync import LAYER, emit

from milepost.core.engine.cuda_staging import CudaStaging
from milepost.core.engine.weight_receiver import WeightReceiver
from milepost.core.engine.weight_routes import load_tensor_payload
from milepost.core.weight_sync import cuda_buffers, wire
from milepost.core.weight_sync.packing import pack_parameters

RESULTS = Path(__file__).parent / "results" / "receiver_python_cpu.txt"
SPECS = [{"name": "embed", "dtype": "bfloat16", "shape": [64, 8]}] + [
    {"name": f"layers_{i}_{n}", "dtype": "bfloat16", "shape": [4, 4]} for i in range(105) for n, _ in LAYER]


class _Weights(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        for s in SPECS:
            self.register_parameter(s["name"], torch.nn.Parameter(torch.zeros(s["shape"], dtype=torch.bfloat16),
                                                                  requires_grad=False))


class _HandMapped:
    """MappedStorages where no GPU can map: the one trainer storage, by hand."""

    def __init__(self, storage: torch.Tensor) -> None:
        self.storage_tensor = storage

    def storage(self, descriptor: dict) -> torch.Tensor:
        return self.storage_tensor

    def new_push(self) -> None:
        pass

    def sweep(self) -> int:
        return 0

    def __len__(self) -> int:
        return 1


def _receiver(in_place: bool) -> tuple[WeightReceiver, list[str]]:
    model = _Weights()
    pack_parameters(model)
    sched = SimpleNamespace(model=model, model_lock=threading.Lock(), weight_version="0", num_running=lambda: 0,
                            memory=SimpleNamespace(update_problem=lambda: None))
    receiver = WeightReceiver(sched)
    receiver.cuda = CudaStaging(receiver, device_type="cpu")
    offsets, total = wire.offsets(SPECS)
    receiver.cuda.mapped = _HandMapped(torch.randn(total // 2).to(torch.bfloat16).view(torch.uint8))  # type: ignore[assignment]
    if not in_place:  # the behaviour before: every push into private shadows
        receiver.in_place_targets = lambda specs: None  # type: ignore[method-assign]
    export = {"device": "GPU-bench", "handle": base64.b64encode(b"h").decode(), "size_bytes": total,
              "offset_bytes": 0, "ref_counter_handle": base64.b64encode(b"rc").decode(), "ref_counter_offset": 0,
              "event_handle": None, "event_sync_required": False}
    per_bucket = -(-len(SPECS) // 4)
    payloads = [cuda_buffers.encode_descriptor(export, [{**s, "offset": o} for s, o in
                                                        zip(SPECS[i:i + per_bucket], offsets[i:i + per_bucket])])
                for i in range(0, len(SPECS), per_bucket)]
    return receiver, payloads


def _colocated_push(receiver: WeightReceiver, payloads: list[str], version: str) -> float:
    shapes = receiver.drop_weights()
    assert not isinstance(shapes, str), shapes
    receiver.allocate_weights(shapes)
    start = time.perf_counter()
    assert receiver.begin("")[0] == 200
    for p in payloads:
        status, text = receiver.run_update(lambda p=p: load_tensor_payload(receiver, p), False, None)
        assert status == 200, text
    receiver.stage_version(version)
    status, text = receiver.end()
    assert status == 200, text
    elapsed = time.perf_counter() - start
    assert not receiver.unloaded
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pushes", type=int, default=20)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    ways = {"in place (now)": _receiver(True), "into shadows (before)": _receiver(False)}
    times: dict[str, list[float]] = {name: [] for name in ways}
    for i in range(args.pushes + 1):  # interleaved, so both ways see the same machine; the first is dropped
        for name, (receiver, payloads) in ways.items():
            elapsed = _colocated_push(receiver, payloads, str(i))
            if i:
                times[name].append(elapsed)
    median = {name: statistics.median(t) for name, t in times.items()}
    cpu = platform.processor() or platform.machine()
    lines = [f"# {datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC, {cpu}, "
             f"torch {torch.__version__}: python bench/receiver_python.py --pushes {args.pushes}",
             f"a colocated push of {len(SPECS)} tensors in 4 buckets (the 3.4 GB shape's count), median of "
             f"{args.pushes}, the engine's Python (no GPU):"]
    lines += [f"{name}: {median[name] * 1e3:.2f} ms" for name in ways]
    lines.append(f"into shadows / in place: {median['into shadows (before)'] / median['in place (now)']:.2f}x")
    emit(lines, args.out)


if __name__ == "__main__":
    main()
