"""Prompt datasets (JSONL or Parquet through fsspec) and a deterministic, resumable cursor."""

from __future__ import annotations

import io
import json
from dataclasses import asdict, dataclass
from typing import Any

import fsspec
import numpy as np

from milepost.core.types import Prompt


def load_rows(path: str, prompt_key: str = "prompt", label_key: str = "label",
              builtin_rows: int = 20000, seed: int = 1) -> list[dict[str, Any]]:
    if path.startswith("builtin:"):
        from milepost.core.data.arith import write_builtin_dataset
        path = write_builtin_dataset(path, builtin_rows, seed)
    fs, fs_path = fsspec.core.url_to_fs(path)
    if not fs.exists(fs_path):
        raise FileNotFoundError(path)
    with fs.open(fs_path, "rb") as f:
        raw = f.read()
    rows = _parse_parquet(raw) if path.endswith(".parquet") else _parse_jsonl(raw, path)
    for i, row in enumerate(rows):
        for key in (prompt_key, label_key):
            if key not in row:
                raise ValueError(f"{path}: row {i} has no `{key}` (keys: {sorted(row)}); set "
                                 "data.prompt_key / data.label_key to the dataset's column names")
    return rows


def _parse_jsonl(raw: bytes, path: str) -> list[dict[str, Any]]:
    rows = []
    for number, line in enumerate(raw.decode().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}: line {number} is not valid JSON ({e.msg}); fix or remove it") from None
        if not isinstance(row, dict):
            raise ValueError(f"{path}: line {number} must be a JSON object")
        rows.append(row)
    return rows


def _parse_parquet(raw: bytes) -> list[dict[str, Any]]:
    import pyarrow.parquet as pq
    return pq.read_table(io.BytesIO(raw)).to_pylist()


@dataclass
class DataCursor:
    epoch: int
    offset: int
    shuffle_seed: int
    num_rows: int

    def to_dict(self) -> dict[str, int]:
        return asdict(self)

    @classmethod
    def from_dict(cls, doc: dict[str, int]) -> "DataCursor":
        return cls(**doc)


class PromptSource:
    """Hands out prompts in a per-epoch permutation; `cursor` says exactly where it stands."""

    def __init__(self, rows: list[dict[str, Any]], tokenizer: Any, cursor: DataCursor,
                 shuffle: bool = True, prompt_key: str = "prompt", label_key: str = "label") -> None:
        if cursor.num_rows != len(rows):
            raise ValueError(f"the dataset has {len(rows)} rows but the checkpoint's cursor was "
                             f"made for {cursor.num_rows}: the dataset changed under the campaign")
        self.rows, self.tokenizer, self.cursor, self.shuffle = rows, tokenizer, cursor, shuffle
        self.prompt_key, self.label_key = prompt_key, label_key

    def _order(self, epoch: int) -> np.ndarray:
        if not self.shuffle:
            return np.arange(len(self.rows))
        return np.random.default_rng([self.cursor.shuffle_seed, epoch]).permutation(len(self.rows))

    def next_batch(self, n: int) -> list[Prompt]:
        out: list[Prompt] = []
        while len(out) < n:
            order = self._order(self.cursor.epoch)
            take = order[self.cursor.offset:self.cursor.offset + n - len(out)]
            out.extend(self._prompt(int(i)) for i in take)
            self.cursor.offset += len(take)
            if self.cursor.offset >= len(order):
                self.cursor.epoch, self.cursor.offset = self.cursor.epoch + 1, 0
        return out

    def _prompt(self, index: int) -> Prompt:
        row = self.rows[index]
        text = str(row[self.prompt_key])
        ids = self.tokenizer.encode(text, add_special_tokens=False) if self.tokenizer else []
        return Prompt(index=index, text=text, label=str(row[self.label_key]), prompt_ids=list(ids))
