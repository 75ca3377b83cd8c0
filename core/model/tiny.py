"""The project's own tiny model: a char tokenizer and a Qwen2, warm-started on tiny-arith.

No model hub is reachable, so the embedded default builds its policy here and saves it in
real Hugging Face format; every later component loads it like any HF checkpoint. The build
is cached by a digest of its config, and written to a temporary folder then renamed, so a
killed build never leaves half a model.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import time
from pathlib import Path

import torch

from milepost.core.config import TinyModelConfig
from milepost.core.data.arith import cache_root, make_rows

log = logging.getLogger(__name__)

BUILD_VERSION = 1
CHARS = list("0123456789+= ")
SPECIALS = ["<pad>", "<eos>"]


def build_tokenizer():
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(SPECIALS + CHARS)}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<pad>"))
    core.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    from tokenizers import decoders
    core.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", eos_token="<eos>")


def _model_config(cfg: TinyModelConfig, tokenizer):
    from transformers import Qwen2Config
    return Qwen2Config(vocab_size=len(tokenizer), hidden_size=cfg.hidden_size,
                       num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_heads,
                       num_key_value_heads=cfg.num_kv_heads, intermediate_size=cfg.intermediate_size,
                       max_position_embeddings=64, tie_word_embeddings=True,
                       pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
                       bos_token_id=tokenizer.eos_token_id, torch_dtype="float32")


def _warmstart_batch(rows, tokenizer, start: int, size: int):
    ids, masks = [], []
    for row in rows[start:start + size]:
        p = tokenizer.encode(row["prompt"], add_special_tokens=False)
        a = tokenizer.encode(row["label"], add_special_tokens=False) + [tokenizer.eos_token_id]
        ids.append(p + a)
        masks.append([0] * len(p) + [1] * len(a))
    width = max(map(len, ids))
    pad = tokenizer.pad_token_id
    x = torch.tensor([r + [pad] * (width - len(r)) for r in ids])
    m = torch.tensor([r + [0] * (width - len(r)) for r in masks], dtype=torch.float32)
    return x, m


def warmstart(model, tokenizer, cfg: TinyModelConfig, seed: int) -> float:
    """Short supervised training on the answers only, so RL starts sometimes right."""
    rows = make_rows(cfg.warmstart_steps * cfg.warmstart_batch_size, seed=seed + 1000, split="train")
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.warmstart_lr)
    loss_value = float("nan")
    model.train()
    for step in range(cfg.warmstart_steps):
        x, m = _warmstart_batch(rows, tokenizer, step * cfg.warmstart_batch_size, cfg.warmstart_batch_size)
        logits = model(input_ids=x).logits[:, :-1]
        nll = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                                x[:, 1:].reshape(-1), reduction="none")
        loss = (nll * m[:, 1:].reshape(-1)).sum() / m[:, 1:].sum()
        opt.zero_grad()
        loss.backward()
        opt.step()
        loss_value = float(loss.detach())
    model.eval()
    return loss_value


def cached_model_dir(cfg: TinyModelConfig, seed: int) -> Path:
    key = json.dumps({"cfg": cfg.model_dump(), "seed": seed, "v": BUILD_VERSION}, sort_keys=True)
    return cache_root() / "models" / f"tiny-arith-{hashlib.sha256(key.encode()).hexdigest()[:16]}"


def build_tiny_model(cfg: TinyModelConfig, seed: int) -> str:
    final = cached_model_dir(cfg, seed)
    if (final / "config.json").exists():
        return str(final)
    from transformers import Qwen2ForCausalLM

    start = time.perf_counter()
    torch.manual_seed(seed)
    tokenizer = build_tokenizer()
    model = Qwen2ForCausalLM(_model_config(cfg, tokenizer))
    loss = warmstart(model, tokenizer, cfg, seed)
    tmp = final.parent / f".tmp-{final.name}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp, safe_serialization=True)
    tokenizer.save_pretrained(tmp)
    (tmp / "milepost_build.json").write_text(json.dumps({"warmstart_loss": loss}))
    if final.exists():
        shutil.rmtree(tmp)
    else:
        tmp.rename(final)
    log.info("built tiny model in %.1fs (warm-start loss %.3f): %s", time.perf_counter() - start, loss, final)
    return str(final)
