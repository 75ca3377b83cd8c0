"""`builtin:gpu-arith`: tiny-arith's tokenizer and build on a ~76 M Qwen2, warm-started on
three-digit additions, on a GPU when there is one (bf16 autocast, fused AdamW, batches of 2048).

What RL is for here is the arithmetic itself, not the answer's form. Of the warm-start rows
whose sum carries, a seeded `warmstart_carry_error_fraction` (0.6) are answered with every
carry forgotten (457+368=715, core/data/arith.sum_without_carries); the others, and every
sum without a carry, with the right value. A model that fits that data answers a carrying
sum wrongly more often than rightly, so its greedy answer is wrong on most of the ~70 % of
held-out sums that carry, while sampling still finds the right value often. The reward
(`arith-value`) checks the value, in either form, so what RL can raise is how often the
value is right: `either_form` accuracy, before (base) and after.

Built once per (config, seed) and cached like tiny-arith (core/model/tiny.py: same
tokenizer, Qwen2 config, warm-start loop, atomic cached build).
"""

from __future__ import annotations

import hashlib
import json
import random
from pathlib import Path
from typing import Any

from milepost.core.config import GpuArithConfig
from milepost.core.data.arith import (
    UNSIMPLIFIED_SUFFIX,
    cache_root,
    has_carry,
    operands,
    sum_without_carries,
)
from milepost.core.model import tiny

# Bump when the build procedure changes, so caches made by an older procedure are not reused.
BUILD_VERSION = 1


def warmstart_targets(rows: list[dict[str, str]], cfg: GpuArithConfig, seed: int) -> list[str]:
    """The answers the warm-start imitates: the sum, or for a seeded share of carrying sums the
    sum with its carries forgotten; then tiny-arith's unsimplified form on its own share."""
    rng = random.Random(f"{seed}-carry-errors")
    values = []
    for row in rows:
        a, b = operands(row["prompt"])
        wrong = has_carry(a, b) and rng.random() < cfg.warmstart_carry_error_fraction
        values.append(str(sum_without_carries(a, b) if wrong else a + b))
    form = random.Random(f"{seed}-unsimplified")
    return [v + (UNSIMPLIFIED_SUFFIX if form.random() < cfg.warmstart_unsimplified_fraction else "") for v in values]


def task(cfg: GpuArithConfig) -> tiny.ArithTask:
    """gpu-arith's warm-start: its world, its targets, on CUDA where present."""
    return tiny.ArithTask(world="gpu-arith", targets=warmstart_targets, prefer_cuda=True,
                          warmup_steps=cfg.warmstart_warmup_steps)


def cached_model_dir(cfg: GpuArithConfig, seed: int) -> Path:
    key = json.dumps({"cfg": cfg.model_dump(), "seed": seed, "v": (tiny.BUILD_VERSION, BUILD_VERSION)},
                     sort_keys=True)
    return cache_root() / "models" / f"gpu-arith-{hashlib.sha256(key.encode()).hexdigest()[:16]}"


def build_gpu_arith_model(cfg: GpuArithConfig, seed: int) -> str:
    """The cached model folder for (cfg, seed), built (and warm-started) on first use."""
    return tiny.build_cached(cached_model_dir(cfg, seed),
                             lambda tmp: tiny._train_and_save(cfg, seed, tmp, task=task(cfg)))


def num_parameters(cfg: GpuArithConfig) -> int:
    """Parameters of the model `cfg` builds (the tied embedding once), counted without building it."""
    import torch
    from transformers import Qwen2ForCausalLM
    with torch.device("meta"):
        model: Any = Qwen2ForCausalLM(tiny._model_config(cfg, tiny.build_tokenizer()))
    return int(model.num_parameters())
