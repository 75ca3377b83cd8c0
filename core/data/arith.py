"""The arithmetic worlds of the builtin models: `a+b=` additions, generated deterministically;
eval pairs never train.

- tiny-arith: operands 0..99 (the 2-layer tiny model's world).
- gpu-arith: operands 0..999, three-digit sums with carries (`builtin:gpu-arith`, a ~76 M
  model warm-started on a GPU; core/model/gpu_arith.py).

An answer counts in *either form* when it is the sum as written (`125`) or unsimplified
(`125+0`, the form tiny-arith's warm-start teaches and its exact-match reward rejects): its
value is right whatever form it is in. The `arith-value` reward and the eval metric
`either_form` (core/evaluate.py) score that.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
from functools import lru_cache
from pathlib import Path
from typing import Any

MAX_OPERAND = 99  # tiny-arith
EVAL_FRACTION = 0.1
# World name -> largest operand. The world is in the dataset's name, so a recipe's data and
# the builtin model it warm-starts agree by naming the same world.
WORLDS = {"tiny-arith": MAX_OPERAND, "gpu-arith": 999}
UNSIMPLIFIED_SUFFIX = "+0"


def cache_root() -> Path:
    return Path(os.environ.get("MILEPOST_CACHE", Path.home() / ".cache" / "milepost"))


def _is_eval_pair(a: int, b: int) -> bool:
    digest = hashlib.sha256(f"{a}+{b}".encode()).digest()
    return digest[0] < int(256 * EVAL_FRACTION)


@lru_cache(maxsize=4)
def _pairs(max_operand: int, split: str) -> list[tuple[int, int]]:
    # Cached: gpu-arith's million pairs take seconds to hash, and a build asks twice.
    return [(a, b) for a in range(max_operand + 1) for b in range(max_operand + 1)
            if _is_eval_pair(a, b) == (split == "eval")]


def make_rows(num_rows: int, seed: int, split: str, max_operand: int = MAX_OPERAND) -> list[dict[str, str]]:
    """`num_rows` rows of split `train` (pairs drawn with replacement) or `eval` (distinct pairs,
    at most ~10% of all); eval pairs are a fixed hash-chosen ~10% of all pairs and never train."""
    if split not in ("train", "eval"):
        raise ValueError(f"arith split must be `train` or `eval`, got `{split}`")
    pairs = _pairs(max_operand, split)
    rng = random.Random(f"{seed}-{split}")
    rows = [pairs[rng.randrange(len(pairs))] for _ in range(num_rows)] if split == "train" else (
        rng.sample(pairs, min(num_rows, len(pairs))))
    return [{"prompt": f"{a}+{b}=", "label": str(a + b)} for a, b in rows]


def operands(prompt: str) -> tuple[int, int]:
    """`57+68=` -> (57, 68)."""
    a, b = prompt.rstrip("=").split("+")
    return int(a), int(b)


def has_carry(a: int, b: int) -> bool:
    """Whether adding a and b column by column carries into any column but a new leading one."""
    return sum_without_carries(a, b) != a + b


def sum_without_carries(a: int, b: int) -> int:
    """The sum with every carry forgotten, the leading column written in full: 57+68 -> 115,
    457+368 -> 715. The classic error the gpu-arith warm-start teaches on some rows."""
    digits, place = 0, 1
    while a >= 10 or b >= 10:
        digits += ((a % 10 + b % 10) % 10) * place
        a, b, place = a // 10, b // 10, place * 10
    return digits + (a + b) * place


def either_form_correct(response: str, label: str) -> bool:
    """The answer's value is the label's: written `125` or unsimplified `125+0`."""
    answer = response.strip()
    return answer in (label.strip(), label.strip() + UNSIMPLIFIED_SUFFIX)


BUILTIN_DATASETS = tuple(f"builtin:{world}/{split}" for world in WORLDS for split in ("train", "eval"))


def check_builtin_dataset(name: str, setting: str = "data.train_path") -> None:
    from milepost.core.errors import UserError
    if name not in BUILTIN_DATASETS:
        raise UserError(f"{setting}: unknown builtin dataset `{name}`; available: {', '.join(BUILTIN_DATASETS)}, "
                        "or a path to a JSONL / Parquet file")


def is_builtin_arith(name: str) -> bool:
    """Whether `name` is one of the arithmetic worlds' builtin datasets."""
    return name in BUILTIN_DATASETS


def write_builtin_dataset(name: str, data_cfg: Any, seed: int) -> str:
    """`builtin:<world>/<split>` → a cached JSONL file (written atomically).

    `data_cfg` is a DataConfig: its num_train_rows / num_eval_rows size the split.
    """
    check_builtin_dataset(name)
    world, split = name.removeprefix("builtin:").split("/")
    num_rows = data_cfg.num_train_rows if split == "train" else data_cfg.num_eval_rows
    path = cache_root() / "data" / f"{world}-{split}-{num_rows}-{seed}.jsonl"
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        # tmp + rename: a killed writer never leaves a truncated file under the final name
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        rows = make_rows(num_rows, seed, split, WORLDS[world])
        tmp.write_text("".join(json.dumps(r) + "\n" for r in rows))
        tmp.replace(path)
    return str(path)
