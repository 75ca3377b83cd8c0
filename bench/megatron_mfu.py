"""Training MFU on one GPU, side by side in one run: plain HF training (eager and with its
decoder layers compiled), the torch backend's step code, and megatron backend variants; a
profile of the main megatron step; then a weight round trip to the built-in engine.

Model: a Qwen3 shape (default Qwen3-1.7B: 28 layers, hidden 2048, 16 heads / 8 KV heads,
head_dim 128, FFN 6144, vocab 151936, tied embeddings), random init (no hub), bf16 compute.
Batch: `--samples` RL samples of `--prompt-len` + `--response-len` tokens, micro-batches of
`--micro-batch` samples, one optimizer step per batch.

- hf: AutoModelForCausalLM (sdpa), fp32 master weights + bf16 autocast, fused AdamW,
  cross-entropy on the response tokens (what FACTS.md's 27 % MFU baseline ran).
  hf-compile: the same with every decoder layer torch.compile'd (the trick megatron gets).
- torch-backend: the TorchBackend rank's micro-batch code (batch.collate +
  logprobs.response_logprobs_and_entropy + algo.losses.rl_loss) on the same kind of model.
- megatron[...]: MegatronRankWorker in this process (world size 1), precision bf16, Megatron
  DDP and optimizer, rl_loss inside megatron's forward-backward schedule; variants set
  train.megatron.fuse, micro_batch_size and packing (`--megatron-variants`).

MFU = tokens/s * 6 * N / peak, N = all parameters (tied embedding once), peak = 989.4 TFLOP/s
(H200 dense bf16). 6N+attn adds 6 * layers * seq * q_dim per token (causal half of 12).
The megatron backend applies the output layer at response positions only (prompt positions'
logits are never used); the exec column counts the FLOPs each trainer executes (6N minus
the skipped output-layer work), so that saving is visible.

Round trip: export the trained megatron weights to HF safetensors, load them as the built-in
engine does (`Scheduler.load`: AutoModelForCausalLM, fp32, CPU), check the engine's tensors
are the exported ones (sha256 as the torch backend computes it), sample with the engine's
Generator, and compare its token logprobs with: HF fp32 (GPU), the megatron model cast to
fp32, the bf16 megatron trainer, and HF bf16 (the last two show bf16's own error). Run 6 (in
bench/results/megatron_mfu.txt) found the engine passing its KV cache as `cache=`, a name the
H200 image's transformers 5.17 swallows (it decoded without context); the engine now passes it
under the name the model's forward takes and fails a batch whose cache stays empty.

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
import traceback
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

PEAK_TFLOPS = 989.4
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # cpu: a dry run of the script (--shape tiny)
SHAPES = {
    "tiny": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                 intermediate_size=128, vocab_size=300, tie_word_embeddings=True, max_position_embeddings=512,
                 rope_theta=1000000.0, rms_norm_eps=1e-6),
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


OUT_PATH: list[Path] = []  # --out: rewritten after every line, so a killed run keeps what it measured


def log(out: list[str], line: str) -> None:
    print(line, flush=True)
    out.append(line)
    for path in OUT_PATH:
        path.write_text("\n".join(out) + "\n")


def make_model(shape: str, folder: str) -> Any:
    from transformers import Qwen3Config, Qwen3ForCausalLM
    cfg = Qwen3Config(**SHAPES[shape], pad_token_id=0, eos_token_id=1, bos_token_id=1)
    torch.manual_seed(0)
    with torch.device(DEVICE):
        model = Qwen3ForCausalLM(cfg)
    # Explicit init: built under a device context, transformers 5 may leave tensors
    # uninitialized (a first run here exported non-finite weights). Norms 1, matrices N(0, 0.02).
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(1.0) if p.dim() == 1 else p.normal_(0.0, cfg.initializer_range)
    model = model.to(torch.bfloat16 if DEVICE == "cuda" else torch.float32)
    assert all(torch.isfinite(p).all() for p in model.parameters())
    model.save_pretrained(folder)
    del model
    empty_cache()
    return cfg


def sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def empty_cache() -> None:
    gc.collect()
    if DEVICE == "cuda":
        torch.cuda.empty_cache()


def reset_peak() -> None:
    if DEVICE == "cuda":
        torch.cuda.reset_peak_memory_stats()


def peak_gib() -> float:
    return torch.cuda.max_memory_allocated() / 2**30 if DEVICE == "cuda" else 0.0


def make_samples(n: int, prompt_len: int, response_len: int, vocab: int, seed: int) -> list[Any]:
    from milepost.core.types import Sample
    rng = random.Random(seed)
    return [Sample(prompt_index=i // 8, group_index=i // 8,
                   prompt_ids=[rng.randrange(2, vocab) for _ in range(prompt_len)],
                   response_ids=[rng.randrange(2, vocab) for _ in range(response_len)],
                   engine_logprobs=[-11.0] * response_len, loss_mask=[1] * response_len, finish_reason="length",
                   weight_version="0", label="", reward=rng.random(), advantage=rng.uniform(-1, 1))
            for i in range(n)]


STEP_TIMES: dict[str, list[float]] = {}


def timed_steps(step: Callable[[], None], warmup: int, steps: int, name: str = "") -> float:
    """Seconds per step (mean over `steps` after `warmup`); each step's time lands in STEP_TIMES."""
    for _ in range(warmup):
        step()
    sync()
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        step()
        sync()
        times.append(time.perf_counter() - t0)
    STEP_TIMES[name] = times
    return sum(times) / steps


def hf_steps(path: str, samples: list[Any], mbs: int, use_rl_loss: bool, compile_layers: bool) -> Callable[[], None]:
    from transformers import AutoModelForCausalLM

    from milepost.core.algo.losses import rl_loss
    from milepost.core.config import AlgoConfig
    from milepost.core.train.batch import collate, count_loss_tokens
    from milepost.core.train.logprobs import response_logprobs_and_entropy
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="sdpa").to(DEVICE)
    model.gradient_checkpointing_disable()
    if compile_layers:
        for layer in model.model.layers:
            layer.compile()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-6, fused=DEVICE == "cuda")
    algo, normalizer = AlgoConfig(), float(count_loss_tokens(samples))
    chunks = [samples[i:i + mbs] for i in range(0, len(samples), mbs)]
    batches = [{k: v.to(DEVICE) for k, v in collate(c, 0).items()} for c in chunks]

    def step() -> None:
        for b in batches:
            with torch.autocast(DEVICE, dtype=torch.bfloat16):
                if use_rl_loss:  # the TorchBackend rank's _micro_batch
                    lp, ent = response_logprobs_and_entropy(model, b, 1.0)
                    loss, _ = rl_loss(lp, lp.detach(), b["engine_logprobs"], b["advantages"], b["loss_mask"],
                                      algo, normalizer, entropy=ent.detach())
                else:
                    labels = torch.where(b["attention_mask"].bool(), b["input_ids"], -100)
                    labels[:, :len(samples[0].prompt_ids)] = -100
                    # use_cache=False: transformers 5 otherwise fills a KV cache in training forwards
                    # (and the compiled layers recompile per cache layer)
                    loss = model(input_ids=b["input_ids"], labels=labels, use_cache=False).loss / len(batches)
            loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
    step.model = model  # type: ignore[attr-defined]
    return step


def parse_variant(text: str) -> dict[str, Any]:
    """'fuse=1,mb=4' / 'fuse=1,pack=8192' -> MegatronRankWorker settings."""
    kv = dict(item.split("=") for item in text.split(","))
    return {"fuse": kv.get("fuse", "1") == "1", "mb": int(kv.get("mb", 4)), "pack": int(kv.get("pack", 0))}


def megatron_worker(path: str, variant: dict[str, Any], precision: str | None = None, algo: Any = None,
                    lr: float = 1e-6, fp8_recipe: Any = None, megatron: dict[str, Any] | None = None) -> Any:
    """A world-size-1 MegatronRankWorker in this process, set up. `precision` None: bf16 on a GPU,
    fp32 on CPU; `algo` None: AlgoConfig(); `fp8_recipe` for precision fp8 (bench/fp8_training.py);
    `megatron`: more train.megatron settings."""
    if "ray" not in sys.modules:
        try:
            import ray  # noqa: F401
        except ImportError:  # the GPU box has no Ray: the worker runs in-process, torch_backend only imports it
            sys.modules["ray"] = types.ModuleType("ray")
    from milepost.core.config import AlgoConfig, TrainConfig
    from milepost.core.train.megatron.worker import MegatronRankWorker
    if precision is None:
        precision = "bf16" if DEVICE == "cuda" else "fp32"  # megatron's bf16 optimizer needs CUDA
    cfg = TrainConfig(backend="megatron", num_ranks=1, micro_batch_size=variant["mb"], lr=lr,
                      megatron={"pack_sequences": variant["pack"] > 0, "micro_batch_tokens": max(1, variant["pack"]),
                                "fuse": variant["fuse"]} | (megatron or {}))
    w = MegatronRankWorker(0, 1, path, cfg, algo or AlgoConfig(), temperature=1.0, seed=0, total_steps=None,
                           precision=precision, fp8_recipe=fp8_recipe)
    w.setup(w.free_port())
    return w


def _is_kernel(e: Any) -> bool:
    """A device-side event that is a kernel or copy (not a user annotation mirrored on the GPU)."""
    from torch.autograd import DeviceType
    name = getattr(e, "key", None) or getattr(e, "name", "")  # FunctionEventAvg has key, FunctionEvent name
    return e.device_type == DeviceType.CUDA and "#" not in name and not name.startswith("ProfilerStep")


def phase_times(worker: Any, step: Callable[[], None]) -> dict[str, float]:
    """One step with a sync around megatron's schedule and the optimizer step: where the wall goes."""
    spent = {"forward-backward": 0.0, "optimizer": 0.0}

    def timed(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def run(*a: Any, **k: Any) -> Any:
            sync()
            t0 = time.perf_counter()
            result = fn(*a, **k)
            sync()
            spent[name] += time.perf_counter() - t0
            return result
        return run
    worker._run_schedule = timed("forward-backward", worker._run_schedule)
    worker.optimizer.step = timed("optimizer", worker.optimizer.step)
    try:
        sync()
        t0 = time.perf_counter()
        step()
        sync()
        total = time.perf_counter() - t0
    finally:
        del worker._run_schedule, worker.optimizer.step  # back to the class methods
    return {"total": total, **spent, "rest (batches, metrics)": total - sum(spent.values())}


def profile_step(step: Callable[[], None], path: Path, title: str) -> list[str]:
    """One step under torch.profiler: GPU kernel time by kind, idle gaps, top kernels (appended to path)."""
    from torch.profiler import ProfilerActivity, profile
    sync()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        step()
        sync()
        wall = time.perf_counter() - t0
    kernels = [e for e in prof.key_averages() if _is_kernel(e)]
    dev = lambda e: getattr(e, "self_device_time_total", 0) or getattr(e, "self_cuda_time_total", 0)  # noqa: E731
    kinds = {"gemm": ("gemm", "cutlass", "xmma", "nvjet", "cublas", "matmul"), "attention": ("flash", "fmha", "attn",
             "cudnn"), "fp8 cast (triton)": ("fp8_cast_tile",), "triton (compiled)": ("triton",), "nccl": ("nccl",)}
    by_kind: dict[str, float] = {}
    for e in kernels:
        kind = next((k for k, keys in kinds.items() if any(s in e.key.lower() for s in keys)), "other (eager)")
        by_kind[kind] = by_kind.get(kind, 0.0) + dev(e) / 1e6
    busy = sum(by_kind.values())
    spans = sorted((e.time_range.start, e.time_range.end, e.name) for e in prof.events() if _is_kernel(e))
    gaps, last_end, last_name = [], spans[0][1] if spans else 0, ""
    for start, end, name in spans[1:]:
        if start > last_end:
            gaps.append((start - last_end, last_name, name))
        if end > last_end:
            last_end, last_name = end, name
    idle = sum(g[0] for g in gaps) / 1e6
    lines = [f"{title}: profiled step wall {wall:.3f}s, GPU kernels {busy:.3f}s ({busy / wall:.0%} busy), gaps between "
             f"first and last kernel {idle:.3f}s; " + ", ".join(f"{k} {v:.3f}s" for k, v in
                                                               sorted(by_kind.items(), key=lambda kv: -kv[1]))]
    top = sorted(kernels, key=dev, reverse=True)[:30]
    table = [f"{dev(e) / 1e3:10.1f} ms {e.count:6d}x  {e.key[:150]}" for e in top]
    table += [f"gap {g / 1e3:7.2f} ms after {a[:70]}  before {b[:70]}" for g, a, b in sorted(gaps, reverse=True)[:12]]
    # the host's side: where the Python thread spends a step (a host-bound step's gaps come from here)
    host = sorted((e for e in prof.key_averages() if not _is_kernel(e) and e.self_cpu_time_total > 0),
                  key=lambda e: e.self_cpu_time_total, reverse=True)
    table += [f"host {sum(e.self_cpu_time_total for e in host) / 1e6:.3f}s of op self time; top:"]
    table += [f"host {e.self_cpu_time_total / 1e3:9.1f} ms {e.count:6d}x  {e.key[:120]}" for e in host[:25]]
    with path.open("a") as f:
        f.write("\n".join(lines + table) + "\n\n")
    return lines


def sync_sites(step: Callable[[], None], path: Path, title: str) -> list[str]:
    """One step under torch.cuda.set_sync_debug_mode("warn"): every call that makes the host wait
    for the GPU (.item(), a copy to the CPU, nonzero, ...), counted by where it is called from
    (the innermost frames; appended to path). Why: each one drains the GPU's queue, and a step
    whose host is barely ahead of its GPU then idles while the host refills it."""
    import collections
    import traceback
    import warnings
    seen: collections.Counter[str] = collections.Counter()

    def note(message: Any, category: Any, filename: str, lineno: int, file: Any = None, line: Any = None) -> None:
        frames = [f for f in traceback.extract_stack()[:-1] if "warnings" not in Path(f.filename).name][-4:]
        seen[" <- ".join(f"{Path(f.filename).name}:{f.lineno} {f.name}" for f in reversed(frames))] += 1

    sync()
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = note
        torch.cuda.set_sync_debug_mode("warn")
        try:
            step()
            sync()
        finally:
            torch.cuda.set_sync_debug_mode(0)
    lines = [f"{title}: {sum(seen.values())} synchronising calls in one step (torch.cuda.set_sync_debug_mode)"]
    table = [f"sync {n:5d}x  {site}" for site, n in seen.most_common(15)]
    with path.open("a") as f:
        f.write("\n".join(lines + table) + "\n\n")
    return lines


def sdpa_bench(cfg: Any, mbs: int, seq: int) -> list[str]:
    """Forward+backward of one layer's attention at the bench's shape, per SDPA backend."""
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel
    hq, hkv, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    q = torch.randn(mbs, hq, seq, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(mbs, hkv, seq, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn_like(k, requires_grad=True)
    flops = 4 * mbs * hq * seq * seq * d / 2 * 3.5  # causal fwd + bwd (2.5x)
    out = []
    for name, backend in (("default", None), ("flash", SDPBackend.FLASH_ATTENTION),
                          ("cudnn", SDPBackend.CUDNN_ATTENTION), ("efficient", SDPBackend.EFFICIENT_ATTENTION)):
        try:
            ctx = sdpa_kernel([backend]) if backend is not None else torch.enable_grad()
            with ctx:
                def run() -> None:
                    o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
                    o.sum().backward()
                s = timed_steps(run, 3, 10)
            out.append(f"{name} {s * 1e3:.2f} ms ({flops / s / 1e12:.0f} TFLOP/s)")
        except Exception as exc:  # noqa: BLE001 - a backend that refuses these inputs
            out.append(f"{name} n/a ({str(exc).splitlines()[0][:60]})")
    return ["sdpa fwd+bwd, one layer [" + f"{mbs}x{hq}/{hkv} heads x {seq} x {d}]: " + "; ".join(out)]


def teacher_forced(model: Any, samples: list[Any], device: str) -> list[list[float]]:
    """train/logprobs.response_logprobs of each sample's response under an HF model."""
    from milepost.core.train.batch import collate
    from milepost.core.train.logprobs import response_logprobs
    with torch.no_grad():
        batch = {k: v.to(device) for k, v in collate(samples, 0).items()}
        lp = response_logprobs(model, batch, 1.0).float().cpu()
    return [lp[i, :len(s.response_ids)].tolist() for i, s in enumerate(samples)]


def megatron_fp32_logprobs(worker: Any, export: str, samples: list[Any]) -> list[list[float]]:
    """A fresh fp32 megatron model of the worker's layout, loaded from the export by the
    converter, scored with the backend's own code path (the bf16 trainer's model in fp32)."""
    from milepost.core.train.megatron import cpu_compat, fusions
    from milepost.core.train.megatron.converter import load_hf_into
    from milepost.core.train.megatron.model import build_gpt_model, transformer_config
    from milepost.core.train.megatron.step import build_micro_batches, forward_hidden, response_logprobs
    out: list[list[float]] = []
    with torch.no_grad(), cpu_compat.activate():
        tcfg = transformer_config(worker.spec, worker.cfg.megatron, torch.float32, on_cpu=DEVICE == "cpu")
        model = build_gpt_model(worker.spec, tcfg).to(worker.device).eval()
        fusions.swap_norms(model, torch.float32, worker.cfg.megatron.fuse)
        load_hf_into([model], export, worker.spec, 0, 1, 0)
        for mb in build_micro_batches(samples, worker.pad_id, False, 4, 0):
            mb = mb.to(worker.device)
            lp = response_logprobs(forward_hidden(model, mb), model, mb, worker.spec.vocab_size, 1, 1.0, False)[0]
            out += [lp[i, :k].tolist() for i, k in enumerate(mb.batch["response_mask"].sum(-1).long().tolist())]
    del model
    return out


def state_sha256(state: dict[str, torch.Tensor]) -> str:
    """torch_backend.state_sha256 (that module needs Ray, absent on the GPU box): sha256 over
    sorted names, each name's utf-8 bytes then its raw contiguous fp32 bytes."""
    import hashlib
    h = hashlib.sha256()
    for name in sorted(state):
        h.update(name.encode())
        h.update(state[name].detach().to(torch.float32).contiguous().cpu().numpy().tobytes())
    return h.hexdigest()


def max_gap(a: list[list[float]], b: list[list[float]]) -> float:
    return max(abs(x - y) for ra, rb in zip(a, b) for x, y in zip(ra, rb))


def round_trip(worker: Any, path: str, out: list[str], vocab: int) -> None:
    from transformers import AutoModelForCausalLM

    from milepost.core.engine.generation import Generator, SamplingParams, make_sequences
    from milepost.core.train.megatron.converter import write_index
    from milepost.core.types import Sample
    torch.backends.cuda.matmul.allow_tf32 = False  # fp32 references must be fp32
    export = tempfile.mkdtemp(prefix="megatron-export-")
    t0 = time.perf_counter()
    write_index(export, worker.export_shards(export, 5 * 2**30))
    (Path(export) / "config.json").write_text((Path(path) / "config.json").read_text())
    export_s = time.perf_counter() - t0
    trained = worker.hf_state_dict()
    exported = load_all(export)
    same = set(exported) == set(trained) and all(torch.equal(exported[k], trained[k]) for k in trained)
    dtypes = sorted({str(t.dtype) for t in exported.values()})
    initial = load_all(path)
    moved = max((trained[k].float() - initial[k].float()).abs().max().item() for k in initial)
    log(out, f"round trip: export {export_s:.1f}s, {len(exported)} tensors ({', '.join(dtypes)}), bit-equal to the "
             f"trainer's: {same}; max |trained - initial| = {moved:.2e}")
    engine_model = AutoModelForCausalLM.from_pretrained(export, dtype=torch.float32).eval()  # Scheduler.load
    engine_sd = engine_model.state_dict()
    sha_export, sha_engine = state_sha256(exported), state_sha256({k: engine_sd[k] for k in exported})
    tied = (engine_model.get_output_embeddings().weight.data_ptr()
            == engine_model.get_input_embeddings().weight.data_ptr())
    log(out, f"round trip: engine weights sha256 {sha_engine[:16]} == export {sha_export[:16]}: "
             f"{sha_engine == sha_export} (fp32 bytes of the {len(exported)} exported names); lm_head tied to "
             f"embed_tokens in the engine: {tied}")
    gen = Generator(engine_model, eos_token_ids=[1], pad_token_id=0)
    rng = random.Random(5)
    prompts = [[rng.randrange(2, vocab) for _ in range(rng.randint(16, 48))] for _ in range(4)]
    seqs = [s for i, p in enumerate(prompts) for s in
            make_sequences(p, SamplingParams(max_new_tokens=16, temperature=1.0, sampling_seed=100 + i), 1)]
    gen.run_batch(seqs)
    samples = [Sample(prompt_index=i, group_index=i, prompt_ids=s.prompt_ids, response_ids=s.output_ids,
                      engine_logprobs=s.output_logprobs, loss_mask=[1] * len(s.output_ids), finish_reason="length",
                      weight_version="1", label="") for i, s in enumerate(seqs)]
    engine = [s.engine_logprobs for s in samples]
    del engine_model, engine_sd
    n_tok = sum(len(r) for r in engine)
    gaps: dict[str, float] = {}
    for dtype in (torch.float32, torch.bfloat16):
        ref = AutoModelForCausalLM.from_pretrained(export, dtype=dtype).to(DEVICE).eval()
        gaps[f"HF {str(dtype)[6:]} ({DEVICE})"] = max_gap(engine, teacher_forced(ref, samples, DEVICE))
        del ref
        empty_cache()
    try:
        gaps["megatron fp32 (export loaded by the converter)"] = max_gap(engine, megatron_fp32_logprobs(
            worker, export, samples))
    except Exception:  # noqa: BLE001 - printed; the trainer's own gap is still measured
        traceback.print_exc()
    gaps[f"megatron trainer ({worker.precision})"] = max_gap(engine, worker.logprobs(samples))
    log(out, f"round trip: built-in engine (fp32, CPU) sampled {n_tok} tokens from the export; max |engine logprob - "
             f"X| over them: " + "; ".join(f"{k}: {v:.2e}" for k, v in gaps.items()))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="qwen3-1.7b", choices=sorted(SHAPES))
    ap.add_argument("--samples", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--response-len", type=int, default=1536)
    ap.add_argument("--micro-batch", type=int, default=4, help="micro-batch of the hf / torch-backend rows")
    ap.add_argument("--trainers", default="hf,hf-compile,torch-backend")
    ap.add_argument("--megatron-variants", default="fuse=1,mb=8;fuse=1,mb=4;fuse=0,mb=8",
                    help="';'-separated; the first is round-tripped")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--sdpa", action="store_true", help="also time SDPA backends at this shape")
    ap.add_argument("--profile", default="", help="profile each megatron variant (one more step), tables here")
    ap.add_argument("--no-round-trip", action="store_true")
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    out: list[str] = []
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        OUT_PATH.append(Path(args.out))
    folder = tempfile.mkdtemp(prefix="mfu-model-")
    cfg = make_model(args.shape, folder)
    n_params = sum(t.numel() for t in load_all(folder).values())
    seq = args.prompt_len + args.response_len
    tokens = args.samples * seq
    attn = 6 * cfg.num_hidden_layers * seq * cfg.num_attention_heads * cfg.head_dim
    skipped_head = 6 * cfg.vocab_size * cfg.hidden_size * args.prompt_len / seq  # per token, megatron only
    device_name = torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu (dry run)"
    import transformers
    log(out, f"{device_name} | torch {torch.__version__} | transformers {transformers.__version__} | {args.shape}: "
             f"{n_params / 1e9:.3f} B params, "
             f"random init | {args.samples} samples x {seq} tokens ({args.prompt_len} prompt + {args.response_len} "
             f"response) per step | {args.warmup} warm-up + {args.steps} timed steps")
    if args.sdpa and DEVICE == "cuda":
        log(out, sdpa_bench(cfg, args.micro_batch, seq)[0])
    samples = make_samples(args.samples, args.prompt_len, args.response_len, cfg.vocab_size, seed=1)
    results: dict[str, tuple[float, float]] = {}  # name -> (s/step, peak GiB)

    def row(name: str) -> str:
        s, peak = results[name]
        tps = tokens / s
        flops_exec = 6 * n_params - (skipped_head if name.startswith("megatron") else 0)
        return (f"{name:<28} {s:7.3f} {tps:7.0f} {tps * 6 * n_params / PEAK_TFLOPS / 1e12:8.1%} "
                f"{tps * (6 * n_params + attn) / PEAK_TFLOPS / 1e12:8.1%} "
                f"{tps * flops_exec / PEAK_TFLOPS / 1e12:6.1%} {peak:9.1f}  "
                + " ".join(f"{t:.3f}" for t in STEP_TIMES.get(name, [])))
    normalizer = float(sum(len(s.response_ids) for s in samples))
    for i, text in enumerate([v for v in args.megatron_variants.split(";") if v]):
        name = f"megatron[{text}]"
        reset_peak()
        worker = None
        try:
            worker = megatron_worker(folder, parse_variant(text))
            step = lambda w=worker: w.train(samples, normalizer)  # noqa: E731
            results[name] = (timed_steps(step, args.warmup, args.steps, name), peak_gib())
            log(out, row(name))
            if args.profile:
                log(out, f"{name} phases (synced): " + ", ".join(f"{k} {v:.3f}s" for k, v in
                                                                 phase_times(worker, step).items()))
                for line in profile_step(step, Path(args.profile), name):
                    log(out, line)
            if i == 0 and not args.no_round_trip:
                round_trip(worker, folder, out, cfg.vocab_size)
        except Exception:  # noqa: BLE001 - reported in the table; the other trainers still run
            traceback.print_exc()
            log(out, f"{name} failed: {traceback.format_exc().splitlines()[-1]}")
        finally:
            if worker is not None:
                worker.shutdown()
            worker = step = None
        empty_cache()
    hf_rows = {"hf": (False, False), "hf-compile": (False, True), "torch-backend": (True, False)}
    for name in [t for t in args.trainers.split(",") if t]:
        reset_peak()
        try:
            step = hf_steps(folder, samples, args.micro_batch, *hf_rows[name])
            results[name] = (timed_steps(step, args.warmup, args.steps, name), peak_gib())
            log(out, row(name))
            del step.model, step  # type: ignore[attr-defined]
        except Exception:  # noqa: BLE001 - reported in the table; the other trainers still run
            log(out, f"{name} failed: {traceback.format_exc().splitlines()[-1]}")
        empty_cache()
    log(out, f"{'trainer':<28} {'s/step':>7} {'tok/s':>7} {'MFU(6N)':>8} {'6N+attn':>8} {'exec':>6} {'peak GiB':>9}"
             f"  steps (s)")
    for name in results:
        log(out, row(name))
    print(json.dumps({k: v[0] for k, v in results.items()}))


if __name__ == "__main__":
    main()
