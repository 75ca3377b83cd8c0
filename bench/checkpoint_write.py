"""A checkpoint save vs a raw write of the same bytes to the same disk, side by side in one run.

python bench/checkpoint_write.py [--backend torch|megatron] [--shape gpu-arith|qwen2-0.5b]
                                 [--rounds 3] [--dir DIR] [--out bench/results/checkpoint_write.txt]

The checkpoint is the one the loop commits (core/loop.py save_checkpoint): the train backend's
`save_state` (weights, Adam moments after one real step, schedule, RNG) and its `export_hf`
(the HF folder engines load), written by `CheckpointManager.save` (payload, state.json, every
file fsynced, sha256 manifest, rename). The baseline writes the same number of bytes from
memory in 64 MiB sequential writes to one file in the same folder, then fsyncs it: what the
disk takes for those bytes with no serialisation, no hashing and no file layout.

Rounds alternate checkpoint / raw so that the page cache and other load hit both alike.
Printed per round: bytes, checkpoint seconds split into payload (the backend's writes),
manifest (fsync + sha256 of every file; it re-reads what was just written) and commit
(rename, latest), verify (a resume's deep check of the new checkpoint: the sha256 of every
file, read from the page cache: the hashing inside the manifest phase; the rest of that phase
is fsync, i.e. the disk writing the payload's buffered bytes), raw seconds, and raw / checkpoint
(the checkpoint's fraction of raw write speed, 1.0 = as fast as the disk takes plain bytes), and
linked_s: the same checkpoint with its HF folder hard-linked from the step's export, as the
loop writes it since 12-07 (core/weight_export.py `link_into`). The median of the rounds is the
result.

The model is random (no hub): `gpu-arith` is builtin:gpu-arith's shape (75.5 M parameters),
`qwen2-0.5b` the 494 M Qwen2 shape of bench/engine_gpu.py. CPU: the torch backend, one rank
(Ray, gloo). GPU: the megatron backend, one rank (dist-checkpointing).
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import ray
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from milepost.core.checkpoint import CheckpointManager
from milepost.core.config import AlgoConfig, TrainConfig
from milepost.core.train.factory import create_backend
from milepost.core.types import Sample
from milepost.core.weight_export import WeightExports

SHAPES = {  # hidden, layers, heads, kv heads, ffn, vocab, tied
    "gpu-arith": (768, 12, 12, 4, 2048, 32, False),
    "qwen2-0.5b": (896, 24, 14, 2, 4864, 151936, True),
}
RAW_CHUNK = 64 << 20


def save_random_model(shape: str, folder: Path) -> str:
    hidden, layers, heads, kv, ffn, vocab, tied = SHAPES[shape]
    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                      num_key_value_heads=kv, intermediate_size=ffn, tie_word_embeddings=tied,
                      max_position_embeddings=512, eos_token_id=1, pad_token_id=0)
    Qwen2ForCausalLM(cfg).save_pretrained(folder)
    return str(folder)


def random_samples(n: int, vocab: int, seed: int) -> list[Sample]:
    """Short RL samples (groups of 4) so that one train step creates the optimizer's moments."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        resp = [rng.randrange(2, vocab) for _ in range(8)]
        prompt = [rng.randrange(2, vocab) for _ in range(8)]
        out.append(Sample(prompt_index=i // 4, group_index=i // 4, prompt_ids=prompt, response_ids=resp,
                          engine_logprobs=[-3.0] * len(resp), loss_mask=[1] * len(resp), finish_reason="stop",
                          weight_version="0", label="", reward=rng.random(), advantage=rng.uniform(-1, 1)))
    return out


def folder_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


def timed_checkpoint(mgr: CheckpointManager, step: int, backend, exports: WeightExports | None = None
                     ) -> dict[str, float]:
    """One committed checkpoint; the payload's time measured inside, manifest and commit after.
    `exports`: the HF folder linked from the step's export (written before, untimed: the loop
    writes it for the push anyway), as core/loop.py does; None: exported afresh."""
    phases: dict[str, float] = {}

    def payload(folder: Path) -> None:
        t = time.perf_counter()
        backend.save_state(str(folder / "trainer"))
        if exports is None or not exports.link_into(step, folder / "hf"):
            assert exports is None, "the step's export could not be linked"
            backend.export_hf(str(folder / "hf"))
        phases["payload_s"] = time.perf_counter() - t
        phases["_payload_end"] = time.perf_counter()

    began = time.perf_counter()
    folder = mgr.save(step, {"step": step}, payload)
    phases["total_s"] = time.perf_counter() - began
    phases["manifest_commit_s"] = time.perf_counter() - phases.pop("_payload_end")
    phases["bytes"] = float(folder_bytes(folder))
    t = time.perf_counter()
    assert mgr.latest_valid(deep=True).step == step  # the manifest's sha256 work alone: files in page cache
    phases["verify_s"] = time.perf_counter() - t
    return phases


def timed_raw_write(folder: Path, num_bytes: int) -> float:
    """num_bytes from memory in 64 MiB writes to one new file, fsynced; the file is removed after."""
    block = os.urandom(RAW_CHUNK)  # incompressible, like weights
    path = folder / f"raw-{time.monotonic_ns()}.bin"
    began = time.perf_counter()
    with path.open("wb", buffering=0) as f:
        left = num_bytes
        while left > 0:
            left -= f.write(memoryview(block)[: min(left, RAW_CHUNK)])
        os.fsync(f.fileno())
    took = time.perf_counter() - began
    path.unlink()
    return took


def train_config(backend: str) -> TrainConfig:
    if backend == "megatron":
        return TrainConfig(backend="megatron", num_ranks=1, micro_batch_size=4, lr=1e-5)
    return TrainConfig(num_ranks=1, micro_batch_size=4, lr=1e-5)


def run(args: argparse.Namespace) -> list[str]:
    root = Path(args.dir or tempfile.mkdtemp(prefix="ckpt-bench-"))
    root.mkdir(parents=True, exist_ok=True)
    model = save_random_model(args.shape, root / "model")
    ray.init(num_cpus=max(2, os.cpu_count() or 2), include_dashboard=False, log_to_driver=False)
    backend = create_backend(model, train_config(args.backend), AlgoConfig(), 1.0, seed=1, total_steps=10,
                             precision="bf16" if args.backend == "megatron" else "fp32")
    lines = []
    try:
        backend.train_step(random_samples(8, SHAPES[args.shape][5], seed=1), step=1)  # Adam's moments exist now
        mgr = CheckpointManager(root / "checkpoints", keep_last=1)
        exports = WeightExports(root / "exports", backend.export_hf)
        rows = []
        for r in range(args.rounds):
            ck = timed_checkpoint(mgr, 2 * r + 1, backend)
            raw_s = timed_raw_write(root, int(ck["bytes"]))
            exports.write(2 * r + 2)
            linked = timed_checkpoint(mgr, 2 * r + 2, backend, exports)
            rows.append({**ck, "raw_s": raw_s, "ratio": raw_s / ck["total_s"], "linked_s": linked["total_s"]})
        lines.append(f"{'round':>5} {'MB':>8} {'ckpt_s':>8} {'payload_s':>9} {'manifest+commit_s':>17} {'verify_s':>8} "
                     f"{'raw_s':>7} {'ckpt_GB/s':>9} {'raw_GB/s':>8} {'raw/ckpt':>8} {'linked_s':>8}")
        for i, row in enumerate(rows):
            gb = row["bytes"] / 1e9
            lines.append(f"{i:>5} {row['bytes'] / 1e6:>8.1f} {row['total_s']:>8.2f} {row['payload_s']:>9.2f} "
                         f"{row['manifest_commit_s']:>17.2f} {row['verify_s']:>8.2f} {row['raw_s']:>7.2f} "
                         f"{gb / row['total_s']:>9.2f} "
                         f"{gb / row['raw_s']:>8.2f} {row['ratio']:>8.2f} {row['linked_s']:>8.2f}")
        med = statistics.median(r["ratio"] for r in rows)
        lines.append(f"checkpoint's fraction of raw write speed (raw_s / ckpt_s), median of {len(rows)}: {med:.2f}")
        share = statistics.median(r["manifest_commit_s"] / r["total_s"] for r in rows)
        lines.append(f"manifest (fsync + sha256 re-read) and commit's share of the checkpoint, median: {share:.2f}")
        linked = statistics.median(r["linked_s"] / r["total_s"] for r in rows)
        lines.append(f"a checkpoint with the HF folder linked from the step's export (linked_s, core/loop.py since "
                     f"12-07) takes {linked:.2f} of the time of one that exports it afresh (ckpt_s), median")
    finally:
        backend.shutdown()
        ray.shutdown()
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", choices=["torch", "megatron"], default="torch")
    parser.add_argument("--shape", choices=sorted(SHAPES), default="gpu-arith")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--dir", default=None, help="where to write (default: a new folder under the temp dir)")
    parser.add_argument("--out", default=None, help="also write the table here")
    args = parser.parse_args()
    load = os.getloadavg()[0]
    device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else f"cpu, {os.cpu_count()} cores"
    header = [f"# bench/checkpoint_write.py {' '.join(sys.argv[1:])}",
              f"# {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, {device}, backend {args.backend}, "
              f"shape {args.shape}, dir {args.dir or tempfile.gettempdir()}, 1-min load {load:.2f} before"]
    lines = header + run(args)
    text = "\n".join(lines) + "\n"
    print(text, end="")
    if args.out:
        Path(args.out).write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
