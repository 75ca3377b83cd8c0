"""Weight transports side by side on one model: GB/s of each, and its ratio to a plain
in-memory copy of the same bytes measured in the same run.

The model is a random-init Qwen2 (about 400 MB fp32 by default) built in a temp folder.
The trainer side is a real Ray actor (TorchBackend, one rank, one torch thread, its
parameters packed as in training; its copy into shared memory runs on WeightSender's copy
threads); the engine is a real built-in
engine server process; every transport goes through its full sequence
(pause → … → continue) over HTTP. A push's GB/s is the model's bytes over the push's wall
time; `send` is over the bucket phase only. Disk also counts the trainer's HF export (its
send column is the load alone).

Run: python bench/weight_sync.py [--repeats 3] [--out bench/results/weight_sync.txt]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from milepost.core.config import AlgoConfig, SyncConfig, TrainConfig
from milepost.core.fleet.client import EngineClient
from milepost.core.fleet.router import free_port
from milepost.core.weight_sync import DistributedTransport, TensorTransport, build_transport

PROMPTS = [[3, 4, 5, 6], [7, 8, 9]]
GREEDY = {"max_new_tokens": 8, "temperature": 0.0, "ignore_eos": True}


def build_model(path: Path, seed: int, layers: int, hidden: int) -> int:
    """Save a random-init Qwen2 at `path`; return its weight bytes (a tied weight once)."""
    torch.manual_seed(seed)
    cfg = Qwen2Config(vocab_size=32000, hidden_size=hidden, intermediate_size=hidden * 11 // 4,
                      num_hidden_layers=layers, num_attention_heads=hidden // 64, num_key_value_heads=4,
                      max_position_embeddings=512, tie_word_embeddings=True, eos_token_id=1, pad_token_id=0)
    model = Qwen2ForCausalLM(cfg).float()
    model.save_pretrained(path)
    return sum(p.numel() * p.element_size() for p in model.parameters())


class CopyBaseline:
    """A plain copy of the model's bytes (one fp32 tensor: the most favourable case for the
    copy) into a preallocated buffer. Measured next to every timed push, because this
    machine's memory bandwidth drifts with what else runs on it."""

    def __init__(self, nbytes: int) -> None:
        self.nbytes = nbytes
        self.src, self.dst = torch.rand(nbytes // 4), torch.empty(nbytes // 4)
        self.dst.copy_(self.src)  # fault every page in first
        self.samples: dict[int, list[float]] = {}

    def measure(self) -> float:
        """Best over 1 thread and torch's default of the median of 3 copies, in GB/s."""
        default, best = torch.get_num_threads(), 0.0
        for threads in sorted({1, default}):
            torch.set_num_threads(threads)
            times = []
            for _ in range(3):
                t0 = time.perf_counter()
                self.dst.copy_(self.src)
                times.append(time.perf_counter() - t0)
            gbs = self.nbytes / statistics.median(times) / 1e9
            self.samples.setdefault(threads, []).append(gbs)
            best = max(best, gbs)
        torch.set_num_threads(default)
        return best


def _gloo_rank(rank: int, port: int, nbytes: int, out: str, streams: int) -> None:
    import torch.distributed as dist

    from milepost.core.weight_sync import groups
    torch.set_num_threads(1)
    pg = groups.init_weight_group("127.0.0.1", port, rank, 2, "bench", 120, streams=streams)
    t = torch.ones(nbytes // 4) if rank == 0 else torch.empty(nbytes // 4)
    times = []
    for _ in range(6):
        dist.barrier(group=pg)
        t0 = time.perf_counter()
        for w in [dist.broadcast(piece, src=0, group=pg, async_op=True) for piece in t.chunk(streams)]:
            w.wait()
        times.append(time.perf_counter() - t0)
    dist.barrier(group=pg)
    if rank == 1:
        Path(out).write_text(str(nbytes / statistics.median(times[1:]) / 1e9))
    groups.destroy_weight_group(pg)


def raw_gloo_gb_per_s(nbytes: int, tmp: Path, streams: int) -> float:
    """The same bytes broadcast between two plain processes (no HTTP, no Ray), cut into one
    piece per stream: the ceiling of the distributed transport on this machine."""
    import torch.multiprocessing as mp
    out = tmp / "gloo.txt"
    mp.spawn(_gloo_rank, args=(free_port(), nbytes, str(out), streams), nprocs=2)
    return float(out.read_text())


def start_engine(model: str, log: Path, *flags: str) -> tuple[subprocess.Popen, EngineClient]:
    """A built-in engine server process on a free port (`flags`: more server flags)."""
    port = free_port()
    log_file = open(log, "wb")  # noqa: SIM115 - the engine process writes it while it runs
    proc = subprocess.Popen([sys.executable, "-m", "milepost.core.engine.server", "--model-path", model,
                             "--host", "127.0.0.1", "--port", str(port), *flags], stdout=log_file,
                            stderr=subprocess.STDOUT)
    client = EngineClient(f"http://127.0.0.1:{port}", timeout_s=600)
    deadline = time.monotonic() + 300
    while not client.health():
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"engine did not start; see {log}")
        time.sleep(0.3)
    return proc, client


def timed_pushes(push: Callable[[str], dict[str, float]], repeats: int, tag: str,
                 copy: CopyBaseline) -> dict[str, Any]:
    """Two warm-up pushes (first-use allocations and page faults: the tensor transport
    alternates two sets of files), then `repeats` timed ones, each right after a copy."""
    cold = push(f"{tag}-warmup-0")
    push(f"{tag}-warmup-1")
    runs = []
    for i in range(repeats):
        copy_gbs = copy.measure()
        r = push(f"{tag}-{i}")
        runs.append({**r, "ratio": copy.nbytes / r["seconds"] / 1e9 / copy_gbs,
                     "send_ratio": copy.nbytes / r["send_seconds"] / 1e9 / copy_gbs})
    med = lambda key: statistics.median(r[key] for r in runs)  # noqa: E731
    return {"cold_s": cold["seconds"], "s": med("seconds"), "send_s": med("send_seconds"),
            "ratio": med("ratio"), "send_ratio": med("send_ratio")}


def main() -> None:
    import ray  # here, not at the top: bench/gpu_weight_sync.py imports this module where Ray is absent

    from milepost.core.train.torch_backend import TorchBackend  # imports Ray
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--bucket-mb", type=float, default=512.0, help="sync.bucket_mb (its default)")
    ap.add_argument("--gloo-streams", type=int, default=SyncConfig().gloo_streams,
                    help="sync.gloo_streams (its default); the 1-stream row runs beside it")
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    lines: list[str] = []

    def say(line: str = "") -> None:
        print(line, flush=True)
        lines.append(line)

    load_before = os.getloadavg()
    tmp = Path(tempfile.mkdtemp(prefix="milepost-bench-sync-"))
    nbytes = build_model(tmp / "engine_start", 0, args.layers, args.hidden)
    build_model(tmp / "trainer", 1, args.layers, args.hidden)
    say(f"# {time.strftime('%Y-%m-%d %H:%M')}: python bench/weight_sync.py {' '.join(sys.argv[1:])}")
    say(f"# weight sync bench: Qwen2 {args.layers} layers, hidden {args.hidden}, fp32, "
        f"{nbytes / 2**20:.0f} MiB of weights; {os.cpu_count()} cores; trainer: 1 Ray actor (1 torch "
        f"thread, parameters packed, tensor copies on 2 threads); 1 engine process; distributed over "
        f"{args.gloo_streams} gloo stream(s) unless its row says otherwise")
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    # one torch thread (the default): a 2-thread torch copy of many tensors stalls whenever the
    # other core is busy (1.1 vs 10 GB/s measured); WeightSender splits its copy its own way
    train_cfg = TrainConfig(num_ranks=1, num_threads_per_rank=1)
    backend = TorchBackend.create(str(tmp / "trainer"), train_cfg, AlgoConfig(), 1.0, seed=0)
    proc, client = start_engine(str(tmp / "engine_start"), tmp / "engine.log")
    results: dict[str, dict[str, Any]] = {}
    outputs: dict[str, Any] = {}
    try:
        def disk_push(version: str) -> dict[str, float]:
            t0 = time.perf_counter()
            export = tmp / "export"
            backend.export_hf(str(export))
            metrics = build_transport("disk", timeout_s=600).push([client], str(export), version)
            return {"seconds": time.perf_counter() - t0, "send_seconds": metrics["sync/seconds"]}

        copy = CopyBaseline(nbytes)
        gloo = {n: raw_gloo_gb_per_s(nbytes, tmp, n) for n in sorted({1, args.gloo_streams})}
        results["disk (export + load)"] = timed_pushes(disk_push, args.repeats, "disk", copy)
        outputs["disk"] = [o["output_ids"] for o in client.generate(PROMPTS, GREEDY)]
        transports = {
            "tensor": build_transport("tensor", timeout_s=600, bucket_mb=args.bucket_mb),
            # SGLang's format (a pickled flattened bucket over torch file_system shared memory,
            # copied in by the engine): what an engine that does not announce the shm descriptor gets
            "tensor (SGLang format)": TensorTransport(600, args.bucket_mb, wire_format="sglang"),
            # the default: flattened over several streams, sent and received in place
            "distributed": build_transport("distributed", timeout_s=600, bucket_mb=args.bucket_mb,
                                           gloo_streams=args.gloo_streams),
            "distributed (per tensor)": DistributedTransport(600, args.bucket_mb, flattened=False,
                                                             gloo_streams=args.gloo_streams),
            # what an SGLang engine gets: one connection, one broadcast per tensor
            "distributed (1 stream)": build_transport("distributed", timeout_s=600, bucket_mb=args.bucket_mb,
                                                      gloo_streams=1),
        }
        for name, transport in transports.items():
            def push(version: str, transport: Any = transport) -> dict[str, float]:
                m = transport.push([client], "", version, backend=backend)
                return {"seconds": m["sync/seconds"], "send_seconds": m["sync/send_seconds"]}
            try:
                results[name] = timed_pushes(push, args.repeats, name.split()[0], copy)
                outputs[name] = [o["output_ids"] for o in client.generate(PROMPTS, GREEDY)]
            finally:
                transport.close()
    finally:
        proc.terminate()
        proc.wait(30)
        backend.shutdown()
        ray.shutdown()
        shutil.rmtree(tmp, ignore_errors=True)
    report(say, nbytes, copy, gloo, results, outputs, args, load_before)
    if args.out:
        Path(args.out).write_text("\n".join(lines) + "\n")


def report(say: Callable[[str], None], nbytes: int, copy: CopyBaseline, gloo: dict[int, float],
           results: dict[str, dict[str, Any]], outputs: dict[str, Any], args: argparse.Namespace,
           load_before: tuple[float, ...]) -> None:
    spans = ", ".join(f"{t} thread{'s' * (t > 1)} {min(v):.2f}-{max(v):.2f} GB/s" for t, v in copy.samples.items())
    say(f"# plain copy into a preallocated buffer (torch, same bytes), measured before every timed push: {spans}")
    say(f"# median of {args.repeats} pushes after two warm-ups (cold: the first); buckets {args.bucket_mb:g} MB")
    say("# GB/s = weight bytes / wall time of the whole push, pause to continue (send: from begin_weight_update")
    say("# to the last bucket taken; tensor starts writing during pause/flush/begin); ratio = that / the faster")
    say("# copy (1 or default threads) measured just before the same push; medians over the pushes")
    say(f"{'transport':<26}{'push s':>8}{'GB/s':>8}{'ratio':>8}{'send GB/s':>11}{'ratio':>8}{'cold s':>8}")
    for name, r in results.items():
        gbs, send = nbytes / r["s"] / 1e9, nbytes / r["send_s"] / 1e9
        say(f"{name:<26}{r['s']:>8.3f}{gbs:>8.2f}{r['ratio']:>8.0%}{send:>11.2f}{r['send_ratio']:>8.0%}"
            f"{r['cold_s']:>8.2f}")
    for name, target in (("tensor", 0.5), ("distributed", 0.2)):
        r = results[name]
        verdict = "met" if r["ratio"] >= target else ("met for the send phase only" if r["send_ratio"] >= target
                                                      else "NOT met")
        say(f"# target {name} >= {target:.0%} of copy: {verdict} (push {r['ratio']:.0%}, send {r['send_ratio']:.0%})")
    best, per_tensor, one = (results[k] for k in ("distributed", "distributed (per tensor)", "distributed (1 stream)"))
    say(f"# distributed over {args.gloo_streams} streams: flattened (the default) vs per tensor "
        f"{per_tensor['s'] / best['s']:.2f}x; vs 1 stream per tensor {one['s'] / best['s']:.2f}x (push time, same run)")
    for n, gbs in gloo.items():
        name, row = ("distributed", best) if n == args.gloo_streams else ("distributed (1 stream)", one)
        say(f"# raw gloo broadcast of the same bytes between two plain processes, {n} stream(s): {gbs:.2f} GB/s "
            f"({name} reaches {nbytes / row['s'] / 1e9 / gbs:.0%} of it)")
    same = all(v == outputs["disk"] for v in outputs.values())
    say(f"# greedy outputs after every transport equal those after the disk load: {same}")
    say(f"# load average (1/5/15 min) before: {' '.join(f'{x:.2f}' for x in load_before)}; "
        f"after: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")


if __name__ == "__main__":
    main()
