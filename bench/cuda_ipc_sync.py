"""Colocated weight sync on one GPU by CUDA IPC vs a device copy: SGLang's payload and
milepost's CUDA format (mapped once), measured side by side in one run.

Two processes on one GPU, as a colocated trainer and engine, talking over a pipe (no HTTP:
this measures the payload's mechanism, not a server; bench/weight_sync.py and
tests/gpu/test_cuda_buffers_gpu.py run the whole push over HTTP). Rows:
- SGLang's format (sglang_wire): the trainer copies its weights bucket by bucket into a reused
  CUDA buffer and pickles a flattened-bucket payload (a fresh IPC handle and event); the
  engine decodes it through milepost's allow-list and copies each tensor into its own
  weights. Once with the engine opening each handle (as SGLang does), once keeping it.
- milepost's CUDA format (cuda_buffers), through the trainer's real sender
  (WeightSender.to_cuda) and the engine's real receiving code: a WeightReceiver session
  (begin, each payload through weight_routes.load_tensor_payload and cuda_staging, the version,
  the commit into live weights packed as the engine packs them on a GPU). Each storage is
  exported and mapped once and each bucket's plan made once. Once with the trainer's weights
  as separate tensors (copied into a bucket buffer), once packed (pack_parameters: the engine
  copies straight out of the trainer's weights). Since 12-06 the push counts begin and commit
  too (before, only the bucket loads: the commit's copy into the live weights was left out).
- The same two, colocated: before each push the engine releases its weights and resumes them
  (drop_weights, allocate_weights: what /release_memory_occupation and
  /resume_memory_occupation do to them), as colocated placement does around every trainer
  step, so the push fills weights a resume left unloaded (received in place, no commit copy).
  The release and resume are timed apart (in the loop they fall in timing/train_s).
The floor: one device-to-device copy of the same bytes in one process. Each phase is the mean
over the pushes after the first (the first maps the storages and makes the plans).

    python bench/cuda_ipc_sync.py [--params-gb 0.99] [--bucket-mb 512] [--pushes 5] [--out FILE]

Prints the table and writes it to FILE (bench/results/cuda_ipc_sync.txt), with the device.
"""

from __future__ import annotations

import argparse
import base64
import datetime
import multiprocessing as mp
import time
from pathlib import Path

import torch

from milepost.core.weight_sync import sglang_wire, wire

RESULTS = Path(__file__).parent / "results" / "cuda_ipc_sync.txt"
LAYER = [("q", [896, 896]), ("k", [128, 896]), ("v", [128, 896]), ("o", [896, 896]),
         ("gate", [4864, 896]), ("up", [4864, 896]), ("down", [896, 4864]), ("norm", [896])]


def model_specs(params_gb: float) -> list[wire.Spec]:
    """Qwen2-0.5B-shaped bf16 layers (and its embedding) up to about `params_gb` GB."""
    specs = [{"name": "embed", "dtype": "bfloat16", "shape": [151936, 896]}]
    i = 0
    while sum(wire.spec_nbytes(s) for s in specs) < params_gb * 1e9:
        specs += [{"name": f"layers.{i}.{n}", "dtype": "bfloat16", "shape": shape} for n, shape in LAYER]
        i += 1
    return specs


def buckets(specs: list[wire.Spec], bucket_bytes: int) -> list[list[wire.Spec]]:
    out: list[list[wire.Spec]] = [[]]
    for s in specs:
        if out[-1] and wire.offsets(out[-1])[1] + wire.spec_nbytes(s) > bucket_bytes:
            out.append([])
        out[-1].append(s)
    return out


def trainer(conn, results, specs: list[wire.Spec], bucket_bytes: int, pushes: int) -> None:
    weights = {s["name"]: torch.randn(s["shape"], device="cuda").to(torch.bfloat16) for s in specs}
    plan = buckets(specs, bucket_bytes)
    flat = sglang_wire.shared_buffer(max(wire.offsets(b)[1] for b in plan), "cuda")
    times, phases = [], {"trainer_copy": 0.0, "encode": 0.0, "engine_round_trip": 0.0}
    for push_index in range(pushes):
        torch.cuda.synchronize()
        start = time.perf_counter()
        for bucket in plan:
            offs, total = wire.offsets(bucket)
            t0 = time.perf_counter()
            torch._foreach_copy_([wire.view(flat, off, spec) for spec, off in zip(bucket, offs)],
                                 [weights[spec["name"]] for spec in bucket])  # one multi-tensor copy
            torch.cuda.synchronize()  # only to time the phases apart (a push needs no sync here)
            t1 = time.perf_counter()
            payload = sglang_wire.encode(flat[:total], bucket)
            t2 = time.perf_counter()
            conn.send(payload)
            conn.recv()  # the engine copied it in: the buffer may be written again
            t3 = time.perf_counter()
            for key, dt in zip(phases, (t1 - t0, t2 - t1, t3 - t2)):
                phases[key] += dt / (pushes - 1) if push_index else 0.0
        times.append(time.perf_counter() - start)
    conn.send(None)
    results.put({"times": times, "buckets": len(plan), "phases": phases, "engine": conn.recv()})


class _Weights(torch.nn.Module):
    """The trainer's weights as a module (WeightSender reads a module's state dict)."""

    def __init__(self, specs: list[wire.Spec]) -> None:
        super().__init__()
        for s in specs:
            self.register_parameter(s["name"].replace(".", "_"), torch.nn.Parameter(
                torch.randn(s["shape"], device="cuda").to(torch.bfloat16), requires_grad=False))


def milepost_specs(specs: list[wire.Spec]) -> list[wire.Spec]:
    return [{**s, "name": s["name"].replace(".", "_")} for s in specs]


def milepost_trainer(conn, results, specs: list[wire.Spec], bucket_bytes: int, pushes: int, layout: str,
                     colocated: bool) -> None:
    """A push as the tensor transport makes it, minus the HTTP: begin, every bucket
    (WeightSender.to_cuda, then the engine's load), then the version and the commit.
    `layout`: copied (a storage per tensor), packed (pack_parameters: back to back in the
    buckets' order) or reversed (one buffer in reverse order, as megatron-core's DDP buffer
    holds Megatron's parameters). `colocated`: the engine releases and resumes its weights
    before each push (untimed)."""
    from milepost.core.train.weight_sender import WeightSender, pack_parameters
    from milepost.core.weight_sync.packing import pack_in_order
    module = _Weights(specs)
    if layout == "packed":
        pack_parameters(module)
    elif layout == "reversed":
        pack_in_order(list(module.parameters())[::-1])
    sender = WeightSender(module)
    plan = [[s["name"] for s in bucket] for bucket in sender.buckets(bucket_bytes)]
    times, phases = [], {"trainer_to_cuda": 0.0, "engine_round_trips": 0.0}
    for push_index in range(pushes):
        if colocated:
            conn.send(("release_resume", None))
            conn.recv()
        torch.cuda.synchronize()
        start = time.perf_counter()
        conn.send(("begin", None))
        conn.recv()
        for i, names in enumerate(plan):
            t0 = time.perf_counter()
            (payload,) = sender.to_cuda(names, i)  # copy (unless packed), sync, JSON (kept after the first push)
            t1 = time.perf_counter()
            conn.send(("load", payload))
            conn.recv()  # the engine copied it in: the buffer may be written again
            if push_index:  # steady state: the first push maps and plans
                phases["trainer_to_cuda"] += (t1 - t0) / (pushes - 1)
                phases["engine_round_trips"] += (time.perf_counter() - t1) / (pushes - 1)
        conn.send(("commit", str(push_index + 1)))
        conn.recv()
        times.append(time.perf_counter() - start)
    conn.send(None)
    results.put({"times": times, "buckets": len(plan), "phases": phases, "engine": conn.recv()})


def milepost_engine(conn, specs: list[wire.Spec], pushes: int) -> None:
    """The built-in engine's receiving code (WeightReceiver: session, core/engine/cuda_staging.py's
    read of each payload through weight_routes.load_tensor_payload, the commit into the live
    weights) over live weights packed as the engine packs them on a GPU at load; only the
    scheduler is a stand-in (the parts the receiver touches, as tests/unit/test_weight_layout.py)."""
    import threading
    from types import SimpleNamespace

    from milepost.core.engine.weight_receiver import WeightReceiver
    from milepost.core.engine.weight_routes import load_tensor_payload
    from milepost.core.weight_sync.packing import pack_parameters
    model = _Weights(specs)
    pack_parameters(model)
    sched = SimpleNamespace(model=model, model_lock=threading.Lock(), weight_version="0", num_running=lambda: 0,
                            memory=SimpleNamespace(update_problem=lambda: None))
    receiver = WeightReceiver(sched)
    phases = {"begin": 0.0, "load": 0.0, "commit": 0.0}
    began = 0
    while (message := conn.recv()) is not None:
        kind, arg = message
        t0 = time.perf_counter()
        if kind == "release_resume":
            shapes = receiver.drop_weights()
            assert not isinstance(shapes, str), shapes
            torch.cuda.empty_cache()  # as the release does: the memory goes back for the trainer
            released = time.perf_counter()
            receiver.allocate_weights(shapes)
            torch.cuda.synchronize()
            if began:
                phases["release"] = phases.get("release", 0.0) + (released - t0) / (pushes - 1)
                phases["resume"] = phases.get("resume", 0.0) + (time.perf_counter() - released) / (pushes - 1)
            conn.send("ok")
            continue
        if kind == "begin":
            began += 1
            status, text = receiver.begin("")
        elif kind == "load":
            status, text = receiver.run_update(lambda payload=arg: load_tensor_payload(receiver, payload), False, None)
        else:
            receiver.stage_version(arg)
            status, text = receiver.end()
            torch.cuda.current_stream().synchronize()  # the commit's copies are done before answering
        assert status == 200, text
        if began > 1:  # steady state: the first push maps and plans
            phases[kind] += (time.perf_counter() - t0) / (pushes - 1)
        conn.send(text)
    conn.send(phases)


def engine(conn, specs: list[wire.Spec], keep_mappings: bool, pushes: int, first_push_buckets: int) -> None:
    """`keep_mappings`: hold the last bucket decoded from each trainer buffer, so the next
    push's handle (the trainer reuses its buffer) is found in torch's cache instead of being
    opened again (cudaIpcOpenMemHandle); SGLang drops it after each load."""
    mine = {s["name"]: torch.empty(s["shape"], dtype=torch.bfloat16, device="cuda") for s in specs}
    local = torch.empty(sum(wire.spec_nbytes(s) for s in specs), dtype=torch.uint8, device="cuda")
    held, phases = [], {"decode": 0.0, "engine_copy": 0.0, "one_copy_of_bucket": 0.0, "local_copy_same_bytes": 0.0}
    seen = 0
    while (payload := conn.recv()) is not None:
        t0 = time.perf_counter()
        flat, got = sglang_wire.decode(base64.b64decode(payload))
        torch.cuda.synchronize()
        t1 = time.perf_counter()
        wire.copy_all([mine[spec["name"]] for spec in got], [wire.view(flat, spec["offset"], spec) for spec in got])
        torch.cuda.synchronize()
        t2 = time.perf_counter()
        raw = flat.view(torch.uint8)  # diagnostics: the same bytes as one copy from the mapped
        local[:raw.numel()].copy_(raw)  # buffer, then as one copy within this process's memory
        torch.cuda.synchronize()
        t3 = time.perf_counter()
        local[raw.numel():2 * raw.numel()].copy_(local[:raw.numel()]) if 2 * raw.numel() <= local.numel() else None
        torch.cuda.synchronize()
        t4 = time.perf_counter()
        seen += 1
        for key, dt in zip(phases, (t1 - t0, t2 - t1, t3 - t2, t4 - t3)):
            if seen > first_push_buckets:  # steady state, summed over a push's buckets
                phases[key] += dt / (pushes - 1)
        held = [flat] if keep_mappings else []
        del flat, raw
        conn.send("ok")
    del held
    conn.send(phases)


def device_copy_s(nbytes: int, repeats: int = 5, device: str = "cuda", to_device: str | None = None) -> float:
    """Seconds of one copy of `nbytes` within the device's memory (the floor pushes are held
    to), or from `device` to `to_device` (GPU to GPU: the floor of a cross-GPU push)."""
    def sync() -> None:
        for d in {device, to_device or device}:
            if d.startswith("cuda"):
                torch.cuda.synchronize(d)
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty(nbytes, dtype=torch.uint8, device=to_device or device)
    dst.copy_(src)
    sync()
    start = time.perf_counter()
    for _ in range(repeats):
        dst.copy_(src)
    sync()
    return (time.perf_counter() - start) / repeats


def fresh_copy_s(nbytes: int, repeats: int = 5) -> float:
    """Seconds of one device copy of `nbytes` into memory allocated just before it, after
    `torch.cuda.empty_cache()` gave the previous destination back to the driver: what a
    colocated push writes into (a memory resume allocates the weights anew). Set beside
    `device_copy_s` (a destination written before), it says how much of a colocated push's
    load over the served one is the GPU's first touch of new memory, not the engine's Python."""
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    total = 0.0
    for _ in range(repeats):
        torch.cuda.empty_cache()
        dst = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
        torch.cuda.synchronize()
        start = time.perf_counter()
        dst.copy_(src)
        torch.cuda.synchronize()
        total += time.perf_counter() - start
        del dst
    return total / repeats


ROWS = {  # row → (trainer, engine, how it is described)
    "sglang-reopen": "SGLang's format, engine opens each handle (as SGLang)",
    "sglang-keep": "SGLang's format, engine keeps the mapping",
    "milepost-copied": "milepost's CUDA format, trainer copies into bucket buffers",
    "milepost-packed": "milepost's CUDA format, trainer weights packed (read in place)",
    "milepost-copied-colocated": "milepost's CUDA format, colocated (engine weights released and resumed "
                                 "before each push), trainer copies into bucket buffers",
    "milepost-packed-colocated": "milepost's CUDA format, colocated, trainer weights packed (read in place)",
    "milepost-reversed": "milepost's CUDA format, trainer weights in one buffer in reverse order (Megatron's "
                         "layout: read in place, tensor by tensor)",
    "milepost-reversed-colocated": "milepost's CUDA format, colocated, trainer weights in one buffer in reverse order",
}


def push(specs: list[wire.Spec], args: argparse.Namespace, row: str) -> dict:
    ctx = mp.get_context("spawn")
    to_engine, to_trainer = ctx.Pipe()
    results = ctx.Queue()
    bucket_bytes = args.bucket_mb << 20
    if row.startswith("milepost"):
        ours = milepost_specs(specs)
        procs = [ctx.Process(target=milepost_trainer, args=(to_engine, results, ours, bucket_bytes, args.pushes,
                                                            row.split("-")[1], row.endswith("colocated"))),
                 ctx.Process(target=milepost_engine, args=(to_trainer, ours, args.pushes))]
    else:
        procs = [ctx.Process(target=trainer, args=(to_engine, results, specs, bucket_bytes, args.pushes)),
                 ctx.Process(target=engine, args=(to_trainer, specs, row == "sglang-keep", args.pushes,
                                                  len(buckets(specs, bucket_bytes))))]
    for p in procs:
        p.start()
    measured = results.get(timeout=600)
    for p in procs:
        p.join(60)
    return measured


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--params-gb", type=float, default=0.99)
    parser.add_argument("--bucket-mb", type=int, default=512)
    parser.add_argument("--pushes", type=int, default=5)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    specs = model_specs(args.params_gb)
    nbytes = sum(wire.spec_nbytes(s) for s in specs)
    rows = {row: push(specs, args, row) for row in ROWS}
    copy_s = device_copy_s(nbytes)
    fresh_s = fresh_copy_s(nbytes)
    lines = [f"# {datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC, {torch.cuda.get_device_name()}, "
             f"torch {torch.__version__}: python bench/cuda_ipc_sync.py --params-gb {args.params_gb} "
             f"--bucket-mb {args.bucket_mb} --pushes {args.pushes}",
             f"weights: {len(specs)} bf16 tensors, {nbytes / 1e9:.3f} GB, {rows['sglang-reopen']['buckets']} buckets",
             f"device copy of the same bytes, one process: {copy_s:.4f} s = {nbytes / copy_s / 1e9:.1f} GB/s",
             f"the same copy into memory allocated just before (after empty_cache, as a memory resume leaves "
             f"the weights): {fresh_s:.4f} s = {nbytes / fresh_s / 1e9:.1f} GB/s, {fresh_s / copy_s:.2f}x the copy"]
    for row, measured in rows.items():
        push_s = min(measured["times"][1:] or measured["times"])  # the first push maps the handles
        lines.append(f"push by CUDA IPC, {ROWS[row]}: best of "
                     f"{len(measured['times'])} (first {measured['times'][0]:.4f} s): {push_s:.4f} s = "
                     f"{nbytes / push_s / 1e9:.1f} GB/s, vs device copy {copy_s / push_s:.3f}")
        phases = {**measured["phases"], **{f"engine {k}": v for k, v in measured["engine"].items()}}
        lines.append("  per push (mean over the pushes after the first, each phase synchronised apart, buckets "
                     "summed): " + ", ".join(f"{k} {v * 1e3:.2f} ms" for k, v in phases.items()))
    def ratio(row: str) -> float:
        return copy_s / min(rows[row]["times"][1:] or rows[row]["times"])
    # the figure: a colocated push (colocated placement releases and resumes the engine's weights
    # around every trainer step) in the layout the loop's recipes push from: the megatron
    # backend's weights lie in one buffer in an order not HF's (here: reverse), read in place. The torch
    # backend packs its weights (the packed row); megatron at TP > 1 (gathered shards) and a sender
    # that quantises on sync (fp8, int4 rollout) copy into bucket buffers (the copied row)
    lines.append(f"tensor_sync_vs_copy: {ratio('milepost-reversed-colocated'):.3f} (colocated, Megatron's layout: "
                 f"one buffer in reverse order, read in place; packed weights (the torch backend): "
                 f"{ratio('milepost-packed-colocated'):.3f}; copied into bucket buffers (megatron at TP > 1, a "
                 f"quantising sender): "
                 f"{ratio('milepost-copied-colocated'):.3f}; into weights the engine serves (not released): "
                 f"copied {ratio('milepost-copied'):.3f}, packed {ratio('milepost-packed'):.3f}, reversed "
                 f"{ratio('milepost-reversed'):.3f}; SGLang's format: {ratio('sglang-reopen'):.3f})")
    emit(lines, args.out)


def emit(lines: list[str], out: Path) -> None:
    """Print a bench's lines and write them to `out` (a results file)."""
    text = "\n".join(lines) + "\n"
    print(text, end="")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)


if __name__ == "__main__":
    main()
