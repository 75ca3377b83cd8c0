"""Built-in engine vs HF `model.generate` on CPU: same tiny model, same batch, greedy.

python bench/engine_cpu.py [--model-path P] [--batch 64] [--prompt-len 8] [--new-tokens 32] [--http]
Prints tokens/s of each and the ratio engine / HF.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time

import torch
from transformers import AutoModelForCausalLM, Qwen2Config, Qwen2ForCausalLM

from milepost.core.engine.generation import Generator, SamplingParams, make_sequences


def build_model(path: str) -> None:
    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=64, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                      eos_token_id=1, pad_token_id=0)
    Qwen2ForCausalLM(cfg).save_pretrained(path)


def best_of(fn, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


def bench_engine(model, prompts, new_tokens: int) -> tuple[float, list[list[int]]]:
    gen = Generator(model, eos_token_ids=[1])
    params = SamplingParams(max_new_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    box: list = []

    def run() -> None:
        seqs = [s for p in prompts for s in make_sequences(p, params, 1)]
        gen.run_batch(seqs)
        box[:] = [s.output_ids for s in seqs]
    return best_of(run, 5), box


def bench_hf(model, prompts, new_tokens: int) -> tuple[float, list[list[int]]]:
    ids = torch.tensor(prompts)  # equal lengths: no padding needed
    box: list = []

    def run() -> None:
        with torch.inference_mode():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                                 min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
        box[:] = out[:, ids.shape[1]:].tolist()
    return best_of(run, 5), box


def bench_http(path: str, prompts, new_tokens: int) -> float:
    from milepost.core.fleet.client import EngineClient
    from milepost.core.fleet.router import free_port

    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "milepost.core.engine.server", "--model-path", path,
                             "--port", str(port)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        client = EngineClient(f"http://127.0.0.1:{port}", timeout_s=120)
        while not client.health():
            time.sleep(0.2)
        sp = {"max_new_tokens": new_tokens, "temperature": 0.0, "ignore_eos": True}
        return best_of(lambda: client.generate(prompts, sp), 5)
    finally:
        proc.terminate()
        proc.wait(15)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model-path")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=8)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--http", action="store_true", help="also time POST /generate on a server process")
    a = ap.parse_args()
    path = a.model_path or tempfile.mkdtemp(prefix="milepost-bench-")
    if not a.model_path:
        build_model(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    g = torch.Generator().manual_seed(1)
    prompts = torch.randint(2, model.config.vocab_size, (a.batch, a.prompt_len), generator=g).tolist()
    n_tok = a.batch * a.new_tokens
    t_engine, out_engine = bench_engine(model, prompts, a.new_tokens)
    t_hf, out_hf = bench_hf(model, prompts, a.new_tokens)
    same = sum(x == y for x, y in zip(out_engine, out_hf))
    print(f"batch {a.batch} x prompt {a.prompt_len} + {a.new_tokens} new tokens, greedy, "
          f"torch threads {torch.get_num_threads()}")
    print(f"engine (direct): {n_tok / t_engine:9.0f} tok/s  ({t_engine * 1e3:.1f} ms)")
    print(f"HF generate:     {n_tok / t_hf:9.0f} tok/s  ({t_hf * 1e3:.1f} ms)")
    print(f"ratio engine/HF: {t_hf / t_engine:.2f}x   identical greedy rows: {same}/{a.batch}")
    if a.http:
        t_http = bench_http(path, prompts, a.new_tokens)
        print(f"engine (HTTP):   {n_tok / t_http:9.0f} tok/s  ({t_http * 1e3:.1f} ms)  "
              f"ratio HTTP/HF: {t_hf / t_http:.2f}x")


if __name__ == "__main__":
    main()
