"""Shared by the integration tests: a tiny random Qwen2 saved in HF format, random training
samples for it, and built-in engine server processes started and stopped by pid (never by
name)."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from milepost.core.fleet.client import EngineClient
from milepost.core.fleet.router import free_port
from milepost.core.types import Sample


def save_tiny_qwen2(path: Path, seed: int, vocab: int = 32, tie_embeddings: bool = False,
                    max_positions: int = 2048) -> str:
    """A 2-layer random Qwen2 (hidden 64) in HF format at `path`; eos 1, pad 0."""
    torch.manual_seed(seed)
    cfg = Qwen2Config(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
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
