"""Whole weight pushes on one GPU, over HTTP, against a device copy of the same bytes.

A built-in engine server on the GPU serves a random Qwen2-0.5B-shaped model (bf16, ~0.99 GB);
the trainer is this process (the same shape on the same GPU, other weights; its sender
called in process: InProcessWeightSource, no Ray). Each transport goes through its whole
sequence (pause, flush, begin, buckets, version, end, continue), as the loop runs it; its
time is `sync/seconds`, measured side by side with one device-to-device copy of the same
bytes. After each transport the engine's greedy outputs must equal those after the first
(every transport serves the same weights). Rows:
- tensor, milepost's CUDA format (what the built-in engine on a GPU gets), the trainer's
  weights copied into bucket buffers, then packed (pack_parameters: read in place);
- tensor, SGLang's format (a pickled CUDA IPC payload per bucket: what SGLang gets);
- distributed over gloo (the engine receives into host memory and copies to the GPU);
- distributed over NCCL with the engine on the trainer's GPU (the only GPU lent): NCCL is
  expected to refuse two ranks of one communicator on one device; the row records what
  happened (a figure or the error);
- with two GPUs visible (a two-GPU kind of the device tool), distributed over NCCL to a second
  engine on GPU 1, as disaggregated placement runs it, held to a peer copy of the same bytes
  from GPU 0 to GPU 1 (NVLink or PCIe: the floor of any cross-GPU push).

    python bench/gpu_weight_sync.py [--pushes 4] [--bucket-mb 512] [--out bench/results/gpu_weight_sync.txt]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from cuda_ipc_sync import device_copy_s
from weight_sync import start_engine

from milepost.core.train.weight_sender import pack_parameters
from milepost.core.train.weight_source import InProcessWeightSource
from milepost.core.weight_sync import DistributedTransport, TensorTransport

PROMPTS = [[3, 4, 5, 6], [7, 8, 9]]
DEVICE = "cuda"  # --device cpu: a smoke run of this script on a machine without a GPU (no figures)
GREEDY = {"max_new_tokens": 8, "temperature": 0.0, "ignore_eos": True}


def qwen2_05b(seed: int, layers: int, device: str) -> torch.nn.Module:
    from transformers import Qwen2Config, Qwen2ForCausalLM
    torch.manual_seed(seed)
    cfg = Qwen2Config(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=layers,
                      num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=1024,
                      tie_word_embeddings=True, eos_token_id=1, pad_token_id=0)
    with torch.device(device):
        return Qwen2ForCausalLM(cfg).to(torch.bfloat16).eval()


def _device_name() -> str:
    return torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu (smoke run, no figures)"


def peer_copy_s(nbytes: int, repeats: int = 10) -> float:
    """Seconds of one copy of `nbytes` from GPU 0 to GPU 1 (the floor of a cross-GPU push)."""
    return device_copy_s(nbytes, repeats, "cuda:0", "cuda:1")


def timed(transport: Any, client: Any, source: Any, pushes: int, tag: str, nbytes: int,
          copy_s_of: Callable[[int], float] | None = None) -> dict[str, Any]:
    """One warm-up push (exports, mappings, groups), then `pushes`, each after a copy of the
    same bytes (`copy_s_of`: a device copy unless told)."""
    first = transport.push([client], "", f"{tag}-warm", backend=source)["sync/seconds"]
    rows = []
    for i in range(pushes):
        copy_s = copy_s_of(nbytes) if copy_s_of else device_copy_s(nbytes, repeats=10, device=DEVICE)
        m = transport.push([client], "", f"{tag}-{i}", backend=source)
        rows.append({"s": m["sync/seconds"], "send_s": m["sync/send_seconds"], "copy_s": copy_s})
    med = {k: statistics.median(r[k] for r in rows) for k in ("s", "send_s", "copy_s")}
    return {"first_s": first, **med, "vs_copy": med["copy_s"] / med["s"], "send_vs_copy": med["copy_s"] / med["send_s"],
            "gb_per_s": nbytes / med["s"] / 1e9}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pushes", type=int, default=4)
    ap.add_argument("--bucket-mb", type=float, default=512.0)
    ap.add_argument("--layers", type=int, default=24, help="Qwen2-0.5B has 24")
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "gpu_weight_sync.txt"))
    args = ap.parse_args()
    global DEVICE
    DEVICE = args.device
    out = Path(args.out)
    lines: list[str] = []
    results: dict[str, Any] = {}

    def say(line: str) -> None:
        print(line, flush=True)
        lines.append(line)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text("\n".join(lines) + "\n")
        out.with_suffix(".json").write_text(json.dumps(results, indent=1) + "\n")

    tmp = Path(tempfile.mkdtemp(prefix="milepost-gpu-sync-"))
    qwen2_05b(0, args.layers, DEVICE).save_pretrained(tmp / "engine_start")
    trainer = qwen2_05b(1, args.layers, DEVICE)
    nbytes = sum(t.numel() * t.element_size() for t in {id(p): p for p in trainer.parameters()}.values())
    say(f"# {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, {_device_name()}, torch "
        f"{torch.__version__}: python bench/gpu_weight_sync.py {' '.join(sys.argv[1:])}")
    say(f"# Qwen2-0.5B shape, bf16, {nbytes / 1e9:.3f} GB; one built-in engine on the trainer's GPU; "
        f"bucket {args.bucket_mb:.0f} MB; median of {args.pushes} pushes after one warm-up, each beside a device copy")
    proc, client = start_engine(str(tmp / "engine_start"), tmp / "engine.log", "--device", DEVICE, "--dtype",
                                "bfloat16", "--mem-fraction-static", "0.3", "--context-length", "512")
    want = None
    try:
        rows: list[tuple[str, Any, bool]] = [
            ("tensor, milepost's CUDA format, weights copied into buckets",
             TensorTransport(600, args.bucket_mb), False),
            ("tensor, milepost's CUDA format, packed weights read in place",
             TensorTransport(600, args.bucket_mb), True),
            ("tensor, SGLang's format (CUDA IPC payload per bucket)",
             TensorTransport(600, args.bucket_mb, wire_format="sglang"), False),
            ("distributed, gloo (engine receives into host memory)",
             DistributedTransport(600, args.bucket_mb, group_backend="gloo", gloo_streams=4), False),
            # last: a refused NCCL group must not leave the engine in a state the other rows see
            ("distributed, NCCL, engine on the trainer's GPU", DistributedTransport(60, args.bucket_mb,
                                                                                   num_attempts=1), False),
        ]
        for name, transport, packed in rows:
            if packed:
                pack_parameters(trainer)
            source = InProcessWeightSource(trainer)
            try:
                r = timed(transport, client, source, args.pushes, name.split(",")[0], nbytes)
                got = [o["output_ids"] for o in client.generate(PROMPTS, GREEDY)]
                want = want or got
                r["serves_the_same"] = got == want
                results[name] = r
                say(f"{name}: {r['s'] * 1e3:.1f} ms = {r['gb_per_s']:.1f} GB/s (first {r['first_s'] * 1e3:.0f} ms; "
                    f"buckets alone {r['send_s'] * 1e3:.1f} ms); device copy {r['copy_s'] * 1e3:.2f} ms; "
                    f"push vs copy {r['vs_copy']:.3f}, buckets vs copy {r['send_vs_copy']:.3f}; "
                    f"same outputs: {r['serves_the_same']}")
            except Exception as exc:  # noqa: BLE001 - a row that cannot run says why, the others still run
                results[name] = {"error": f"{type(exc).__name__}: {exc}"[:600]}
                say(f"{name}: failed: {results[name]['error']}")
            finally:
                transport.close()
        if DEVICE == "cuda" and torch.cuda.device_count() >= 2:
            _second_gpu_row(tmp, trainer, args, nbytes, results, say)
    finally:
        proc.terminate()
        proc.wait(60)


def _second_gpu_row(tmp: Path, trainer: torch.nn.Module, args: argparse.Namespace, nbytes: int,
                    results: dict[str, Any], say: Callable[[str], None]) -> None:
    """NCCL to an engine on GPU 1 (disaggregated), against a GPU 0 -> GPU 1 copy."""
    name = "distributed, NCCL, engine on a second GPU"
    proc, client = start_engine(str(tmp / "engine_start"), tmp / "engine_gpu1.log", "--device", "cuda:1", "--dtype",
                                "bfloat16", "--mem-fraction-static", "0.3", "--context-length", "512")
    transport = DistributedTransport(600, args.bucket_mb, num_attempts=1)
    try:
        r = timed(transport, client, InProcessWeightSource(trainer), args.pushes, "nccl-gpu1", nbytes, peer_copy_s)
        results[name] = r
        say(f"{name}: {r['s'] * 1e3:.1f} ms = {r['gb_per_s']:.1f} GB/s (first {r['first_s'] * 1e3:.0f} ms; "
            f"buckets alone {r['send_s'] * 1e3:.1f} ms); GPU 0 -> GPU 1 copy {r['copy_s'] * 1e3:.2f} ms; "
            f"push vs peer copy {r['vs_copy']:.3f}, buckets vs peer copy {r['send_vs_copy']:.3f}")
    except Exception as exc:  # noqa: BLE001 - recorded, as every row
        results[name] = {"error": f"{type(exc).__name__}: {exc}"[:600]}
        say(f"{name}: failed: {results[name]['error']}")
    finally:
        transport.close()
        proc.terminate()
        proc.wait(60)


if __name__ == "__main__":
    main()
