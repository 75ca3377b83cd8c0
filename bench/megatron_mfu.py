"""Training MFU on one GPU, side by side in one run: plain HF training, the torch backend's
step code, and the megatron backend; then a weight round trip to the built-in engine.

Model: a Qwen3 shape (default Qwen3-1.7B: 28 layers, hidden 2048, 16 heads / 8 KV heads,
head_dim 128, FFN 6144, vocab 151936, tied embeddings), random init (no hub), bf16 compute.
Batch: `--samples` RL samples of `--prompt-len` + `--response-len` tokens, micro-batches of
`--micro-batch` samples, one optimizer step per batch.

- hf: AutoModelForCausalLM (sdpa), fp32 master weights + bf16 autocast, fused AdamW,
  cross-entropy on the response tokens (what FACTS.md's 27 % MFU baseline ran).
- torch-backend: the TorchBackend rank's micro-batch code (batch.collate +
  logprobs.response_logprobs_and_entropy + algo.losses.rl_loss) on the same kind of model.
  The TorchBackend class itself is CPU-only (gloo, fp32), so its step code is run here.
- megatron: MegatronRankWorker in this process (world size 1), precision bf16, Megatron DDP
  and optimizer, the same rl_loss inside megatron's forward-backward schedule.

MFU = tokens/s * 6 * N / peak, N = all parameters (tied embedding once), peak = 989.4 TFLOP/s
(H200 dense bf16); the attention-inclusive figure adds 6 * layers * seq * q_dim per token
(causal half of 12). Round trip: export the trained megatron weights to HF safetensors, check
them bit-equal to the trainer's, load them as the built-in engine does
(AutoModelForCausalLM, fp32) and sample with its Generator; compare the engine's token
logprobs with the megatron trainer's on the same tokens.

Usage: python bench/megatron_mfu.py --out bench/results/megatron_mfu.txt
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import sys
import tempfile
import time
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

PEAK_TFLOPS = 989.4
SHAPES = {
    "qwen3-1.7b": dict(hidden_size=2048, num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8,
                       head_dim=128, intermediate_size=6144, vocab_size=151936, tie_word_embeddings=True,
                       max_position_embeddings=40960, rope_theta=1000000.0, rms_norm_eps=1e-6),
    "qwen3-4b": dict(hidden_size=2560, num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8,
                     head_dim=128, intermediate_size=9728, vocab_size=151936, tie_word_embeddings=True,
                     max_position_embeddings=40960, rope_theta=1000000.0, rms_norm_eps=1e-6),
}


def load_all(folder: str) -> dict[str, torch.Tensor]:
    """Every tensor of an HF folder (one file or several shards)."""
    from safetensors.torch import load_file
    out: dict[str, torch.Tensor] = {}
    for f in sorted(Path(folder).glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


def log(out: list[str], line: str) -> None:
    print(line, flush=True)
    out.append(line)


def make_model(shape: str, folder: str) -> Any:
    from transformers import Qwen3Config, Qwen3ForCausalLM
    cfg = Qwen3Config(**SHAPES[shape], pad_token_id=0, eos_token_id=1, bos_token_id=1)
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = Qwen3ForCausalLM(cfg)
    # Explicit init: built under a device context, transformers 5 may leave tensors
    # uninitialized (a first run here exported non-finite weights). Norms 1, matrices N(0, 0.02).
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(1.0) if p.dim() == 1 else p.normal_(0.0, cfg.initializer_range)
    model = model.to(torch.bfloat16)
    assert all(torch.isfinite(p).all() for p in model.parameters())
    model.save_pretrained(folder)
    del model
    torch.cuda.empty_cache()
    return cfg


def make_samples(n: int, prompt_len: int, response_len: int, vocab: int, seed: int) -> list[Any]:
    from milepost.core.types import Sample
    rng = random.Random(seed)
    return [Sample(prompt_index=i // 8, group_index=i // 8, prompt_ids=[rng.randrange(2, vocab) for _ in range(prompt_len)],
                   response_ids=[rng.randrange(2, vocab) for _ in range(response_len)],
                   engine_logprobs=[-11.0] * response_len, loss_mask=[1] * response_len, finish_reason="length",
                   weight_version="0", label="", reward=rng.random(), advantage=rng.uniform(-1, 1))
            for i in range(n)]


def timed_steps(step: Callable[[], None], warmup: int, steps: int) -> float:
    """Seconds per step (mean over `steps` after `warmup`)."""
    for _ in range(warmup):
        step()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(steps):
        step()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / steps


def hf_steps(path: str, samples: list[Any], mbs: int, use_rl_loss: bool) -> Callable[[], None]:
    from milepost.core.algo.losses import rl_loss
    from milepost.core.config import AlgoConfig
    from milepost.core.train.batch import collate, count_loss_tokens
    from milepost.core.train.logprobs import response_logprobs_and_entropy
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="sdpa").cuda()
    model.gradient_checkpointing_disable()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-6, fused=True)
    algo, normalizer = AlgoConfig(), float(count_loss_tokens(samples))
    chunks = [samples[i:i + mbs] for i in range(0, len(samples), mbs)]
    batches = [{k: v.cuda() for k, v in collate(c, 0).items()} for c in chunks]

    def step() -> None:
        for b in batches:
            with torch.autocast("cuda", dtype=torch.bfloat16):
                if use_rl_loss:  # the TorchBackend rank's _micro_batch
                    lp, ent = response_logprobs_and_entropy(model, b, 1.0)
                    loss, _ = rl_loss(lp, lp.detach(), b["engine_logprobs"], b["advantages"], b["loss_mask"],
                                      algo, normalizer, entropy=ent.detach())
                else:
                    labels = torch.where(b["attention_mask"].bool(), b["input_ids"], -100)
                    labels[:, :len(samples[0].prompt_ids)] = -100
                    loss = model(input_ids=b["input_ids"], labels=labels).loss / len(batches)
            loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
    step.model = model  # type: ignore[attr-defined]
    return step


def megatron_worker(path: str, mbs: int) -> Any:
    if "ray" not in sys.modules:
        try:
            import ray  # noqa: F401
        except ImportError:  # the GPU box has no Ray: the worker runs in-process, torch_backend only imports it
            sys.modules["ray"] = types.ModuleType("ray")
    from milepost.core.config import AlgoConfig, TrainConfig
    from milepost.core.train.megatron.worker import MegatronRankWorker
    cfg = TrainConfig(backend="megatron", num_ranks=1, precision="bf16", micro_batch_size=mbs, lr=1e-6,
                      megatron={"pack_sequences": False})
    w = MegatronRankWorker(0, 1, path, cfg, AlgoConfig(), temperature=1.0, seed=0, total_steps=None)
    w.setup(w.free_port())
    return w


def round_trip(worker: Any, path: str, out: list[str], vocab: int) -> None:
    from milepost.core.engine.generation import (
        Generator,
        SamplingParams,
        make_sequences,
    )
    from milepost.core.train.batch import collate
    from milepost.core.train.logprobs import response_logprobs
    from milepost.core.train.megatron.converter import write_index
    from milepost.core.types import Sample
    from transformers import AutoModelForCausalLM
    export = tempfile.mkdtemp(prefix="megatron-export-")
    t0 = time.perf_counter()
    write_index(export, worker.export_shards(export, 5 * 2**30))
    (Path(export) / "config.json").write_text((Path(path) / "config.json").read_text())
    export_s = time.perf_counter() - t0
    trained = worker.hf_state_dict()
    exported = load_all(export)
    same = set(exported) == set(trained) and all(torch.equal(exported[k], trained[k].to(exported[k].dtype))
                                                 for k in trained)
    finite = all(torch.isfinite(t).all() for t in trained.values())
    initial = load_all(path)
    moved = max((trained[k].float() - initial[k].float()).abs().max().item() for k in initial)
    log(out, f"round trip: export {export_s:.1f}s, {len(exported)} tensors, bit-equal to the trainer's: {same}, "
             f"all finite: {finite}; max |trained - initial| = {moved:.2e}")
    engine_model = AutoModelForCausalLM.from_pretrained(export, dtype=torch.float32).eval()  # Scheduler.load
    gen = Generator(engine_model, eos_token_ids=[1], pad_token_id=0)
    rng = random.Random(5)
    prompts = [[rng.randrange(2, vocab) for _ in range(16)] for _ in range(2)]
    seqs = [s for i, p in enumerate(prompts) for s in
            make_sequences(p, SamplingParams(max_new_tokens=8, temperature=1.0, sampling_seed=100 + i), 1)]
    gen.run_batch(seqs)
    samples = [Sample(prompt_index=i, group_index=i, prompt_ids=s.prompt_ids, response_ids=s.output_ids,
                      engine_logprobs=s.output_logprobs, loss_mask=[1] * len(s.output_ids), finish_reason="length",
                      weight_version="1", label="") for i, s in enumerate(seqs)]
    trainer_lp = worker.logprobs(samples)
    diff = max(abs(a - b) for s, row in zip(samples, trainer_lp) for a, b in zip(s.engine_logprobs, row))
    # Reference for that gap: the same export run by HF in bf16 on the GPU. A deep random-init model
    # amplifies bf16 rounding, so bf16 vs fp32 alone can differ by O(1) here.
    del engine_model
    device = "cuda" if torch.cuda.is_available() else "cpu"
    ref_model = AutoModelForCausalLM.from_pretrained(export, dtype=torch.bfloat16).to(device).eval()
    with torch.no_grad():
        batch = {k: v.to(device) for k, v in collate(samples, 0).items()}
        ref_lp = response_logprobs(ref_model, batch, 1.0).cpu()
    ref = max(abs(a - ref_lp[i, j].item()) for i, s in enumerate(samples) for j, a in enumerate(s.engine_logprobs))
    log(out, f"round trip: built-in engine (fp32, CPU) sampled {sum(len(s.output_ids) for s in seqs)} tokens from the "
             f"export; max |engine logprob - megatron trainer (bf16) logprob| = {diff:.3e}; the same for HF bf16 "
             f"on the GPU loading the export (bf16 vs fp32 reference): {ref:.3e}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="qwen3-1.7b", choices=sorted(SHAPES))
    ap.add_argument("--samples", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--response-len", type=int, default=1536)
    ap.add_argument("--micro-batch", type=int, default=4)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    out: list[str] = []
    folder = tempfile.mkdtemp(prefix="mfu-model-")
    cfg = make_model(args.shape, folder)
    n_params = sum(t.numel() for t in load_all(folder).values())
    seq = args.prompt_len + args.response_len
    tokens = args.samples * seq
    attn = 6 * cfg.num_hidden_layers * seq * cfg.num_attention_heads * cfg.head_dim
    log(out, f"{torch.cuda.get_device_name()} | torch {torch.__version__} | {args.shape}: {n_params / 1e9:.3f} B params, "
             f"random init | {args.samples} samples x {seq} tokens ({args.prompt_len} prompt + {args.response_len} "
             f"response) per step, micro-batches of {args.micro_batch} | {args.warmup} warm-up + {args.steps} timed steps")
    samples = make_samples(args.samples, args.prompt_len, args.response_len, cfg.vocab_size, seed=1)
    results: dict[str, float] = {}
    for name, rl in (("hf", False), ("torch-backend", True)):
        step = hf_steps(folder, samples, args.micro_batch, rl)
        results[name] = timed_steps(step, args.warmup, args.steps)
        del step.model, step  # type: ignore[attr-defined]
        gc.collect()
        torch.cuda.empty_cache()
    worker = megatron_worker(folder, args.micro_batch)
    normalizer = float(sum(len(s.response_ids) for s in samples))
    results["megatron"] = timed_steps(lambda: worker.train(samples, normalizer), args.warmup, args.steps)
    log(out, f"peak memory {torch.cuda.max_memory_allocated() / 2**30:.1f} GiB (max over the three)")
    log(out, f"{'trainer':<14} {'s/step':>7} {'tok/s':>9} {'MFU(6N)':>8} {'MFU(6N+attn)':>13}")
    for name, s in results.items():
        tps = tokens / s
        log(out, f"{name:<14} {s:7.3f} {tps:9.0f} {tps * 6 * n_params / PEAK_TFLOPS / 1e12:8.1%} "
                 f"{tps * (6 * n_params + attn) / PEAK_TFLOPS / 1e12:13.1%}")
    log(out, f"megatron / hf: {results['hf'] / results['megatron']:.2f}x; megatron / torch-backend: "
             f"{results['torch-backend'] / results['megatron']:.2f}x")
    round_trip(worker, folder, out, cfg.vocab_size)
    worker.shutdown()
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text("\n".join(out) + "\n")
    print(json.dumps(results))


if __name__ == "__main__":
    main()
