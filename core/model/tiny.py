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
import math
import os
import shutil
import time
from pathlib import Path
from typing import Any, Callable

import torch

from milepost.core.config import TinyModelConfig
from milepost.core.data.arith import cache_root, make_rows

log = logging.getLogger(__name__)

# Bump when the build procedure changes, so caches made by an older procedure are not reused.
BUILD_VERSION = 3
CHARS = list("0123456789+= ")
SPECIALS = ["<pad>", "<eos>"]  # ids 0 and 1; prompts need no <bos>, the model learns from "a+b="
REPORT_FILE = "milepost_build.json"
NUM_EVAL_ROWS = 200


def build_tokenizer() -> Any:
    """WordLevel over single characters, wrapped so `AutoTokenizer.from_pretrained` loads it."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(SPECIALS + CHARS)}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<pad>"))
    core.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    core.decoder = decoders.Fuse()  # join characters back without spaces
    # unk_token is explicit: AutoTokenizer loads qwen2 folders as Qwen2Tokenizer, which would
    # otherwise add an out-of-vocabulary <|endoftext|> token as its unk.
    return PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", eos_token="<eos>",
                                   unk_token="<pad>")


def _model_config(cfg: TinyModelConfig, tokenizer: Any) -> Any:
    from transformers import Qwen2Config
    return Qwen2Config(vocab_size=len(tokenizer), hidden_size=cfg.hidden_size,
                       num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_heads,
                       num_key_value_heads=cfg.num_kv_heads, intermediate_size=cfg.intermediate_size,
                       max_position_embeddings=64, tie_word_embeddings=True,
                       pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
                       bos_token_id=tokenizer.eos_token_id, torch_dtype="float32")


UNSIMPLIFIED_SUFFIX = "+0"


def warmstart_targets(rows: list[dict[str, str]], unsimplified_fraction: float, seed: int) -> list[str]:
    """The answers the warm-start imitates: the label, or (for a seeded `unsimplified_fraction`
    of rows) the label written unsimplified as `<label>+0`, which exact match rejects.

    This is the imperfect supervised data RL is for: the base policy knows the sums but often
    writes them in a form the reward does not accept, so it is right only sometimes."""
    import random
    rng = random.Random(f"{seed}-unsimplified")
    return [row["label"] + (UNSIMPLIFIED_SUFFIX if rng.random() < unsimplified_fraction else "")
            for row in rows]


def _warmstart_batch(rows: list[dict[str, str]], targets: list[str], tokenizer: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """prompt + target + eos, right-padded; the mask selects target and eos tokens only."""
    ids, masks = [], []
    for row, target in zip(rows, targets):
        p = tokenizer.encode(row["prompt"], add_special_tokens=False)
        a = tokenizer.encode(target, add_special_tokens=False) + [tokenizer.eos_token_id]
        ids.append(p + a)
        masks.append([0] * len(p) + [1] * len(a))
    width = max(map(len, ids))
    x = torch.tensor([r + [tokenizer.pad_token_id] * (width - len(r)) for r in ids])
    m = torch.tensor([r + [0] * (width - len(r)) for r in masks], dtype=torch.float32)
    return x, m


def warmstart(model: Any, tokenizer: Any, cfg: TinyModelConfig, seed: int, aux_loss_coef: float = 0.0) -> float:
    """Short supervised training on the answers only, so RL starts sometimes right.
    `aux_loss_coef` (MoE models): weight of the router's load-balancing loss, so every expert
    keeps being used and routing stays a real choice."""
    bs = cfg.warmstart_batch_size
    rows = make_rows(cfg.warmstart_steps * bs, seed=seed + 1000, split="train")
    targets = warmstart_targets(rows, cfg.warmstart_unsimplified_fraction, seed)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.warmstart_lr)
    # Cosine decay + clipping: a constant lr made the final accuracy swing 5%..60% across seeds.
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.5 * (1 + math.cos(math.pi * s / max(1, cfg.warmstart_steps))))
    loss_value = float("nan")
    model.train()
    for step in range(cfg.warmstart_steps):
        x, m = _warmstart_batch(rows[step * bs:(step + 1) * bs], targets[step * bs:(step + 1) * bs], tokenizer)
        out = model(input_ids=x, output_router_logits=True) if aux_loss_coef else model(input_ids=x)
        logits = out.logits[:, :-1]
        nll = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                                x[:, 1:].reshape(-1), reduction="none")
        loss = (nll * m[:, 1:].reshape(-1)).sum() / m[:, 1:].sum()
        if aux_loss_coef:
            loss = loss + aux_loss_coef * out.aux_loss
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        loss_value = float(loss.detach())
    model.eval()
    return loss_value


@torch.no_grad()
def greedy_accuracy(model: Any, tokenizer: Any, rows: list[dict[str, str]], max_new_tokens: int = 5) -> float:
    """Exact-match accuracy of greedy answers; prompts are batched by length so no padding."""
    by_len: dict[int, list[dict[str, str]]] = {}
    for row in rows:
        by_len.setdefault(len(row["prompt"]), []).append(row)
    correct = 0
    for group in by_len.values():
        x = torch.tensor([tokenizer.encode(r["prompt"], add_special_tokens=False) for r in group])
        start = x.shape[1]
        for _ in range(max_new_tokens):  # no KV cache: sequences are a dozen tokens long
            x = torch.cat([x, model(input_ids=x).logits[:, -1].argmax(-1, keepdim=True)], dim=1)
        for row, ids in zip(group, x[:, start:].tolist()):
            ids = ids[:ids.index(tokenizer.eos_token_id)] if tokenizer.eos_token_id in ids else ids
            correct += tokenizer.decode(ids, skip_special_tokens=True).strip() == row["label"]
    return correct / max(1, len(rows))


def cached_model_dir(cfg: TinyModelConfig, seed: int) -> Path:
    key = json.dumps({"cfg": cfg.model_dump(), "seed": seed, "v": BUILD_VERSION}, sort_keys=True)
    return cache_root() / "models" / f"tiny-arith-{hashlib.sha256(key.encode()).hexdigest()[:16]}"


def _dense_model(cfg: TinyModelConfig, tokenizer: Any) -> Any:
    from transformers import Qwen2ForCausalLM
    return Qwen2ForCausalLM(_model_config(cfg, tokenizer))


def _train_and_save(cfg: TinyModelConfig, seed: int, out: Path,
                    make_model: Callable[[TinyModelConfig, Any], Any] = _dense_model,
                    aux_loss_coef: float = 0.0) -> dict[str, float]:
    """Build with `make_model(cfg, tokenizer)`, warm-start, measure and save into `out`."""
    start = time.perf_counter()
    torch.set_num_threads(2)  # the embedded default targets a 2-core machine
    torch.manual_seed(seed)
    tokenizer = build_tokenizer()
    model = make_model(cfg, tokenizer).float()
    loss = warmstart(model, tokenizer, cfg, seed, aux_loss_coef) if aux_loss_coef else warmstart(model, tokenizer, cfg, seed)
    accuracy = greedy_accuracy(model, tokenizer, make_rows(NUM_EVAL_ROWS, seed=seed, split="eval"))
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    report = {"warmstart_loss": loss, "eval_accuracy": accuracy, "eval_rows": float(NUM_EVAL_ROWS),
              "build_seconds": time.perf_counter() - start}
    (out / REPORT_FILE).write_text(json.dumps(report, indent=1))
    return report


def build_tiny_model(cfg: TinyModelConfig, seed: int) -> str:
    """The cached model folder for (cfg, seed), built on first use."""
    return build_cached(cached_model_dir(cfg, seed), lambda tmp: _train_and_save(cfg, seed, tmp))


def build_cached(final: Path, train_and_save: Callable[[Path], dict[str, float]]) -> str:
    """`final`, built by `train_and_save(tmp)` into a temporary folder then renamed, unless it exists."""
    if (final / "config.json").exists():
        return str(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.parent / f".tmp-{final.name}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        report = train_and_save(tmp)
        if final.exists():  # another process finished first: its model is identical
            shutil.rmtree(tmp)
        else:
            tmp.rename(final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    log.info("built tiny model in %.1fs (warm-start loss %.3f, greedy eval accuracy %.3f): %s",
             report["build_seconds"], report["warmstart_loss"], report["eval_accuracy"], final)
    return str(final)


build = build_tiny_model  # short name used by model.loading


def build_report(path: str) -> dict[str, float]:
    """The warm-start loss, eval accuracy and build time recorded when the model was built."""
    return json.loads((Path(path) / REPORT_FILE).read_text())
