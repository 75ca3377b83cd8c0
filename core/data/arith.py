"""tiny-arith: two-number addition, generated deterministically; eval pairs never train."""

from __future__ import annotations

import hashlib
import json
import os
import random
from pathlib import Path
from typing import Any

MAX_OPERAND = 99
EVAL_FRACTION = 0.1


def cache_root() -> Path:
    return Path(os.environ.get("MILEPOST_CACHE", Path.home() / ".cache" / "milepost"))


def _is_eval_pair(a: int, b: int) -> bool:
    digest = hashlib.sha256(f"{a}+{b}".encode()).digest()
    return digest[0] < int(256 * EVAL_FRACTION)


def make_rows(num_rows: int, seed: int, split: str) -> list[dict[str, str]]:
    """`num_rows` rows of split `train` (pairs drawn with replacement) or `eval` (distinct pairs,
    at most ~1,000); eval pairs are a fixed hash-chosen ~10% of all 10,000 and never train."""
    if split not in ("train", "eval"):
        raise ValueError(f"tiny-arith split must be `train` or `eval`, got `{split}`")
    pairs = [(a, b) for a in range(MAX_OPERAND + 1) for b in range(MAX_OPERAND + 1)
             if _is_eval_pair(a, b) == (split == "eval")]
    rng = random.Random(f"{seed}-{split}")
    rows = [pairs[rng.randrange(len(pairs))] for _ in range(num_rows)] if split == "train" else (
        rng.sample(pairs, min(num_rows, len(pairs))))
    return [{"prompt": f"{a}+{b}=", "label": str(a + b)} for a, b in rows]


BUILTIN_DATASETS = ("builtin:tiny-arith/train", "builtin:tiny-arith/eval")


def check_builtin_dataset(name: str, setting: str = "data.train_path") -> None:
    from milepost.core.errors import UserError
    if name not in BUILTIN_DATASETS:
        raise UserError(f"{setting}: unknown builtin dataset `{name}`; available: {', '.join(BUILTIN_DATASETS)}, "
                        "or a path to a JSONL / Parquet file")


def write_builtin_dataset(name: str, data_cfg: Any, seed: int) -> str:
    """`builtin:tiny-arith/<split>` → a cached JSONL file (written atomically).

    `data_cfg` is a DataConfig: its num_train_rows / num_eval_rows size the split.
    """
    check_builtin_dataset(name)
    split = name.rsplit("/", 1)[1]
    num_rows = data_cfg.num_train_rows if split == "train" else data_cfg.num_eval_rows
    path = cache_root() / "data" / f"tiny-arith-{split}-{num_rows}-{seed}.jsonl"
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        # tmp + rename: a killed writer never leaves a truncated file under the final name
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        tmp.write_text("".join(json.dumps(r) + "\n" for r in make_rows(num_rows, seed, split)))
        tmp.replace(path)
    return str(path)
