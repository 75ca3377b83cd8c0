"""Shared by the integration tests: a tiny random Qwen2 saved in HF format, random training
samples for it, built-in engine server processes started and stopped by pid (never by
name), samples drawn from an engine, and the weights an engine serves."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from milepost.core.fleet.client import EngineClient
from milepost.core.fleet.router import free_port
from milepost.core.types import Sample


def save_tiny_qwen2(path: Path, seed: int, vocab: int = 32, tie_embeddings: bool = False,
                    max_positions: int = 2048, hidden: int = 64, intermediate: int = 128) -> str:
    """A 2-layer random Qwen2 (hidden 64 unless told) in HF format at `path`; eos 1, pad 0."""
    torch.manual_seed(seed)
    cfg = Qwen2Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=max_positions,
                      tie_word_embeddings=tie_embeddings, eos_token_id=1, pad_token_id=0)
    Qwen2ForCausalLM(cfg).save_pretrained(path)
    return str(path)


def random_train_samples(n: int, seed: int, vocab: int) -> list[Sample]:
    """Training samples over a tiny vocabulary: groups of 3, random prompts and responses (the
    last response token of longer ones without loss), engine logprobs near -3.5, rewards and
    advantages in [0, 1) and [-1, 1)."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        prompt = [rng.randrange(2, vocab) for _ in range(rng.randint(2, 6))]
        resp = [rng.randrange(2, vocab) for _ in range(rng.randint(1, 7))]
        mask = [1] * len(resp)
        if len(resp) > 2:
            mask[-1] = 0  # a response token without loss
        out.append(Sample(prompt_index=i // 3, group_index=i // 3, prompt_ids=prompt, response_ids=resp,
                          engine_logprobs=[-3.5 + rng.uniform(-0.3, 0.3) for _ in resp], loss_mask=mask,
                          finish_reason="stop", weight_version="0", label="", reward=rng.random(),
                          advantage=rng.uniform(-1.0, 1.0)))
    return out


def start_engines(model_path: str, log_dir: Path, count: int = 1, *extra_args: str,
                  startup_timeout_s: float = 120.0) -> list[tuple[subprocess.Popen, EngineClient]]:
    """`count` engine processes serving `model_path`, started together (their start-ups
    overlap), each healthy before this returns."""
    started = []
    for i in range(count):
        port = free_port()
        log_file = open(log_dir / f"engine{i}.log", "wb")  # noqa: SIM115 - the engine writes it while it runs
        proc = subprocess.Popen(
            [sys.executable, "-m", "milepost.core.engine.server", "--model-path", model_path,
             "--host", "127.0.0.1", "--port", str(port), *extra_args],
            stdout=log_file, stderr=subprocess.STDOUT)
        started.append((proc, EngineClient(f"http://127.0.0.1:{port}", timeout_s=60)))
    deadline = time.monotonic() + startup_timeout_s
    for proc, client in started:
        while not client.health():
            if proc.poll() is not None or time.monotonic() > deadline:
                stop_engines(started)
                raise RuntimeError(f"engine did not start; see {log_dir}")
            time.sleep(0.2)
    return started


def stop_engines(started: list[tuple[subprocess.Popen, EngineClient]]) -> None:
    """Stop the processes we started: TERM (CONT first, in case a test stopped one), then KILL."""
    for proc, _ in started:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGCONT)
            proc.terminate()
    for proc, _ in started:  # uvicorn waits for open requests (e.g. a rendezvous that lost its peer)
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)


def engine_samples(client: EngineClient, prompts: list[list[int]], seed: int) -> list[Sample]:
    """2 samples per prompt from the engine (6 new tokens, temperature 1), with its logprobs;
    advantage +1 for the first sample of each prompt, -1 for the second."""
    n = len(prompts)
    params = [{"max_new_tokens": 6, "temperature": 1.0, "ignore_eos": True, "sampling_seed": seed * 100 + i}
              for i in range(2 * n)]
    outs = client.generate(prompts * 2, params, return_logprob=True)
    return [Sample(prompt_index=i % n, group_index=i % n, prompt_ids=prompts[i % n], response_ids=o["output_ids"],
                   engine_logprobs=[lp for lp, _, _ in o["meta_info"]["output_token_logprobs"]],
                   loss_mask=[1] * len(o["output_ids"]), finish_reason="length", weight_version=str(seed), label="",
                   advantage=1.0 if i < n else -1.0) for i, o in enumerate(outs)]


def served_weight(url: str, name: str) -> torch.Tensor:
    """The tensor `name` as the engine's matmuls use it (SGLang's /get_weights_by_name), float32."""
    reply = httpx.post(f"{url}/get_weights_by_name", json={"name": name, "truncate_size": 10**6}, timeout=30)
    reply.raise_for_status()
    return torch.tensor(reply.json(), dtype=torch.float32)
