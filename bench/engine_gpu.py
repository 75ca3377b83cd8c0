"""The built-in engine's fast path on a GPU, side by side with HF `generate` and the
bandwidth floor, in one run.

Shape: a random-init Qwen2-0.5B (494 M parameters, bf16), prompts of 128 tokens, 256 new
tokens each (ignore_eos), temperature 1. For batch 64 and 256:
- HF `generate` with a static cache and `torch.compile(mode="default")` of the forward
  (the baseline of ../shared/FACTS.md; its compile warm-up is not timed);
- the engine's decode (continuous.ContinuousGenerator over static_model.StaticDecoder with
  CUDA graphs), in-process, after a warm-up run that captures the graphs (capture time
  printed apart);
- the floor: (weights + the mean KV cache read) bytes per decode step over the measured
  device-copy bandwidth.
Also: a sequence's tokens alone vs inside the batch (batch-invariant mode and default).

    python bench/engine_gpu.py [--batches 64 256] [--skip-hf]

Prints the table and writes bench/results/engine_gpu.txt and engine_gpu.json.
"""

from __future__ import annotations

import argparse
import datetime
import json
import time
from pathlib import Path

import torch
from cuda_ipc_sync import device_copy_s  # bench/ is on the path when run as a script

from milepost.core.engine.continuous import ContinuousGenerator
from milepost.core.engine.generation import SamplingParams, Sequence
from milepost.core.engine.static_model import kv_bytes_per_token

RESULTS = Path(__file__).parent / "results"
PROMPT, NEW = 128, 256


def qwen2_05b() -> torch.nn.Module:
    from transformers import Qwen2Config, Qwen2ForCausalLM
    cfg = Qwen2Config(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                      num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=32768,
                      tie_word_embeddings=True, eos_token_id=151643, pad_token_id=151643)
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = Qwen2ForCausalLM(cfg).to(torch.bfloat16).eval()
    return model


def copy_bandwidth(nbytes: int = 2**31, repeats: int = 10) -> float:
    """Device copy, bytes read + written per second (FACTS.md's convention)."""
    return 2 * nbytes / device_copy_s(nbytes, repeats)


def prompts(batch: int, vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(batch)
    return torch.randint(0, vocab, (batch, PROMPT), generator=g).tolist()


def hf_compiled(model: torch.nn.Module, batch: int) -> float:
    """tok/s of HF generate, static cache, compiled forward (second call timed)."""
    ids = torch.tensor(prompts(batch, model.config.vocab_size), device="cuda")
    model.generation_config.cache_implementation = "static"
    compiled = torch.compile(model.forward, mode="default")
    plain, model.forward = model.forward, compiled
    try:
        kw = dict(max_new_tokens=NEW, min_new_tokens=NEW, do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
                  attention_mask=torch.ones_like(ids))
        with torch.inference_mode():
            model.generate(ids, **kw)  # compiles
            torch.cuda.synchronize()
            start = time.perf_counter()
            out = model.generate(ids, **kw)
            torch.cuda.synchronize()
        assert out.shape[1] == PROMPT + NEW
        return batch * NEW / (time.perf_counter() - start)
    finally:
        model.forward = plain
        model.generation_config.cache_implementation = None
        torch._dynamo.reset()


def engine_run(gen: ContinuousGenerator, rows: list[list[int]], seed0: int = 0) -> tuple[float, list[Sequence]]:
    seqs = [Sequence(list(p), SamplingParams(max_new_tokens=NEW, temperature=1.0, ignore_eos=True), seed=seed0 + i)
            for i, p in enumerate(rows)]
    queue, done = list(seqs), []
    torch.cuda.synchronize()
    start = time.perf_counter()
    gen.run(lambda free: [queue.pop(0) for _ in range(min(free, len(queue)))], done.append)
    torch.cuda.synchronize()
    elapsed = time.perf_counter() - start
    assert all(len(s.output_ids) == NEW for s in seqs)
    return len(rows) * NEW / elapsed, seqs


def engine_tok_s(model: torch.nn.Module, batch: int) -> tuple[float, float]:
    """(tok/s of a timed run, seconds of the warm-up run that captured the graphs)."""
    gen = ContinuousGenerator(model, [], num_slots=batch, max_len=PROMPT + NEW)
    start = time.perf_counter()
    engine_run(gen, prompts(batch, model.config.vocab_size))
    warm = time.perf_counter() - start
    tok_s, _ = engine_run(gen, prompts(batch, model.config.vocab_size))
    return tok_s, warm


def floor_tok_s(model: torch.nn.Module, batch: int, bandwidth: float) -> float:
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    kv = kv_bytes_per_token(model.config, torch.bfloat16) * batch * (PROMPT + NEW / 2)
    return batch / ((weights + kv) / bandwidth)


def batch_invariance(model: torch.nn.Module) -> dict[str, float]:
    """Fraction of 16 sequences whose tokens are the same alone and among 64."""
    rows = prompts(64, model.config.vocab_size)
    out = {}
    for invariant in (False, True):
        gen = ContinuousGenerator(model, [], num_slots=64, max_len=PROMPT + NEW, batch_invariant=invariant)
        _, together = engine_run(gen, rows)
        same = sum(engine_run(gen, [rows[i]], seed0=i)[1][0].output_ids == together[i].output_ids
                   for i in range(16))
        out["batch_invariant" if invariant else "default"] = same / 16
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, nargs="+", default=[64, 256])
    parser.add_argument("--skip-hf", action="store_true")
    args = parser.parse_args()
    model = qwen2_05b()
    bandwidth = copy_bandwidth()
    result: dict = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                    "date": f"{datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC",
                    "command": "python bench/engine_gpu.py " + " ".join(f"--batches {b}" for b in args.batches),
                    "copy_bandwidth_GBps": bandwidth / 1e9, "rows": {}}
    lines = [f"# {result['date']}, {result['device']}, torch {torch.__version__}: {result['command']}",
             f"Qwen2-0.5B shape, bf16, prompt {PROMPT}, {NEW} new tokens; device copy {bandwidth / 1e12:.2f} TB/s"]
    for batch in args.batches:
        ours, warm = engine_tok_s(model, batch)
        floor = floor_tok_s(model, batch, bandwidth)
        row = {"engine_tok_s": ours, "engine_warmup_s": warm, "floor_tok_s": floor, "fraction_of_floor": ours / floor}
        if not args.skip_hf:
            hf = hf_compiled(model, batch)
            row.update(hf_compiled_tok_s=hf, engine_vs_hf_compiled=ours / hf)
        result["rows"][batch] = row
        hf_text = (f"HF generate static+compile {row['hf_compiled_tok_s']:,.0f} tok/s, ratio "
                   f"{row['engine_vs_hf_compiled']:.2f}x; " if "hf_compiled_tok_s" in row else "")
        lines.append(f"batch {batch}: engine {ours:,.0f} tok/s (warm-up incl. graph capture {warm:.1f} s); "
                     f"{hf_text}floor {floor:,.0f} tok/s, engine = {ours / floor:.3f} of floor")
    result["alone_vs_batch_same_tokens"] = batch_invariance(model)
    lines.append(f"same tokens alone as in a batch of 64 (16 sequences): {result['alone_vs_batch_same_tokens']}")
    text = "\n".join(lines) + "\n"
    print(text, end="")
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "engine_gpu.txt").write_text(text)
    (RESULTS / "engine_gpu.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
