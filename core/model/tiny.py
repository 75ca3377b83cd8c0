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
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from milepost.core.config import TinyModelConfig
from milepost.core.data.arith import UNSIMPLIFIED_SUFFIX, WORLDS, cache_root, make_rows
from milepost.core.model.warmstart import (
    Schedule,
    greedy_accuracy,
    train_device,
    warmstart,
)

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
    # torch_dtype: a key transformers takes through **kwargs (not a field of every version)
    return Qwen2Config(vocab_size=len(tokenizer), hidden_size=cfg.hidden_size,  # type: ignore[call-arg]
                       num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_heads,
                       num_key_value_heads=cfg.num_kv_heads, intermediate_size=cfg.intermediate_size,
                       max_position_embeddings=64, tie_word_embeddings=True,
                       pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
                       bos_token_id=tokenizer.eos_token_id, torch_dtype="float32")


def warmstart_targets(rows: list[dict[str, str]], unsimplified_fraction: float, seed: int) -> list[str]:
    """The answers the warm-start imitates: the label, or (for a seeded `unsimplified_fraction`
    of rows) the label written unsimplified as `<label>+0`, which exact match rejects.

    This is the imperfect supervised data RL is for: the base policy knows the sums but often
    writes them in a form the reward does not accept, so it is right only sometimes."""
    import random
    rng = random.Random(f"{seed}-unsimplified")
    return [row["label"] + (UNSIMPLIFIED_SUFFIX if rng.random() < unsimplified_fraction else "")
            for row in rows]


def _tiny_targets(rows: list[dict[str, str]], cfg: TinyModelConfig, seed: int) -> list[str]:
    return warmstart_targets(rows, cfg.warmstart_unsimplified_fraction, seed)


@dataclass(frozen=True)
class ArithTask:
    """What a builtin model is warm-started on and measured with: its arithmetic world's rows
    (core/data/arith.py), the answers it imitates (`targets(rows, cfg, seed)`), where it trains."""

    world: str = "tiny-arith"
    targets: Callable[[list[dict[str, str]], Any, int], list[str]] = _tiny_targets
    # tiny-arith's numbers are CPU numbers: its build stays on the CPU even beside a GPU.
    prefer_cuda: bool = False
    warmup_steps: int = 0

    def rows(self, num_rows: int, seed: int, split: str) -> list[dict[str, str]]:
        return make_rows(num_rows, seed, split, WORLDS[self.world])


TINY_ARITH = ArithTask()


def cached_model_dir(cfg: TinyModelConfig, seed: int) -> Path:
    key = json.dumps({"cfg": cfg.model_dump(), "seed": seed, "v": BUILD_VERSION}, sort_keys=True)
    return cache_root() / "models" / f"tiny-arith-{hashlib.sha256(key.encode()).hexdigest()[:16]}"


def _dense_model(cfg: TinyModelConfig, tokenizer: Any) -> Any:
    from transformers import Qwen2ForCausalLM
    return Qwen2ForCausalLM(_model_config(cfg, tokenizer))


def _train_and_save(cfg: TinyModelConfig, seed: int, out: Path,
                    make_model: Callable[[TinyModelConfig, Any], Any] = _dense_model,
                    aux_loss_coef: float = 0.0, task: ArithTask = TINY_ARITH) -> dict[str, Any]:
    """Build with `make_model(cfg, tokenizer)`, warm-start on `task`, measure and save into `out`."""
    start = time.perf_counter()
    device = train_device(task.prefer_cuda)
    if device.type == "cpu":
        torch.set_num_threads(2)  # the embedded default targets a 2-core machine
    torch.manual_seed(seed)
    tokenizer = build_tokenizer()
    model = make_model(cfg, tokenizer).float().to(device)
    rows = task.rows(cfg.warmstart_steps * cfg.warmstart_batch_size, seed + 1000, "train")
    schedule = Schedule(cfg.warmstart_steps, cfg.warmstart_batch_size, cfg.warmstart_lr, task.warmup_steps)
    loss = warmstart(model, tokenizer, rows, task.targets(rows, cfg, seed), schedule, aux_loss_coef)
    trained_s = time.perf_counter() - start
    scores = greedy_accuracy(model, tokenizer, task.rows(NUM_EVAL_ROWS, seed, "eval"))
    model.to("cpu").save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    report = {"warmstart_loss": loss, "eval_accuracy": scores["accuracy"], "eval_either_form": scores["either_form"],
              "eval_rows": float(NUM_EVAL_ROWS), "device": str(device), "warmstart_seconds": trained_s,
              "build_seconds": time.perf_counter() - start}
    (out / REPORT_FILE).write_text(json.dumps(report, indent=1))
    return report


def build_tiny_model(cfg: TinyModelConfig, seed: int) -> str:
    """The cached model folder for (cfg, seed), built on first use."""
    return build_cached(cached_model_dir(cfg, seed), lambda tmp: _train_and_save(cfg, seed, tmp))


def build_cached(final: Path, train_and_save: Callable[[Path], dict[str, Any]]) -> str:
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


def build_report(path: str) -> dict[str, Any]:
    """The warm-start loss, eval accuracies, device and build time recorded when the model was built."""
    return json.loads((Path(path) / REPORT_FILE).read_text())
