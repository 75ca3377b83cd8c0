"""Prompt datasets (JSONL or Parquet through fsspec) and a deterministic, resumable cursor."""

from __future__ import annotations

import io
import json
from dataclasses import asdict, dataclass
from typing import Any

import fsspec
import numpy as np

from milepost.core.config import DataConfig
from milepost.core.types import Prompt


class DatasetNotFoundError(ValueError, FileNotFoundError):
    """A user mistake (ValueError) that callers catching FileNotFoundError still see."""


def load_rows(path: str, prompt_key: str = "prompt", label_key: str = "label", *,
              setting: str = "data.train_path", data_cfg: DataConfig | None = None,
              builtin_rows: int | None = None, seed: int = 1) -> list[dict[str, Any]]:
    """Rows of a JSONL or Parquet file (local path or fsspec URL) or a `builtin:` dataset.

    `setting` is the recipe key the path came from, named in errors. Builtin datasets are
    sized by `data_cfg` (or `builtin_rows`, which overrides both splits' row counts).
    """
    if path.startswith("builtin:"):
        from milepost.core.data.arith import write_builtin_dataset
        cfg = data_cfg or DataConfig()
        if builtin_rows is not None:
            cfg = cfg.model_copy(update={"num_train_rows": builtin_rows, "num_eval_rows": builtin_rows})
        path = write_builtin_dataset(path, cfg, seed)
    fs, fs_path = fsspec.core.url_to_fs(path)
    if not fs.isfile(fs_path):
        raise DatasetNotFoundError(f"{setting}: dataset `{path}` does not exist; fix the path in the "
                                   f"recipe or pass --set {setting}=...")
    with fs.open(fs_path, "rb") as f:
        raw = f.read()
    rows = _parse_parquet(raw, path) if fs_path.endswith(".parquet") else _parse_jsonl(raw, path)
    for i, row in enumerate(rows):
        _check_keys(row, i, path, prompt_key, label_key)
    return rows


def _check_keys(row: dict[str, Any], i: int, path: str, prompt_key: str, label_key: str) -> None:
    for key, setting in ((prompt_key, "data.prompt_key"), (label_key, "data.label_key")):
        if key not in row:
            raise ValueError(f"{path}: row {i} has no `{key}` (its keys: {sorted(row)}); set "
                             f"{setting} to the dataset's column name")


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


def _parse_parquet(raw: bytes, path: str) -> list[dict[str, Any]]:
    import pyarrow as pa
    import pyarrow.parquet as pq
    try:
        return pq.read_table(io.BytesIO(raw)).to_pylist()
    except pa.ArrowException as e:
        raise ValueError(f"{path}: not a readable Parquet file ({e}); rewrite it or use JSONL") from None


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
        expected = {"epoch", "offset", "shuffle_seed", "num_rows"}
        if set(doc) != expected:
            raise ValueError(f"data cursor has keys {sorted(doc)}, expected {sorted(expected)}: "
                             "the checkpoint was not written by this version of milepost")
        return cls(**{k: int(v) for k, v in doc.items()})


class PromptSource:
    """Hands out prompts in a per-epoch permutation; `cursor` says exactly where it stands."""

    def __init__(self, rows: list[dict[str, Any]], tokenizer: Any, cursor: DataCursor,
                 shuffle: bool = True, prompt_key: str = "prompt", label_key: str = "label") -> None:
        if not rows:
            raise ValueError("the prompt dataset is empty; point data.train_path at a file with rows")
        if cursor.num_rows != len(rows):
            raise ValueError(f"the dataset has {len(rows)} rows but the checkpoint's cursor was "
                             f"made for {cursor.num_rows}: the dataset changed under the campaign")
        self.rows, self.tokenizer, self.cursor, self.shuffle = rows, tokenizer, cursor, shuffle
        self.prompt_key, self.label_key = prompt_key, label_key
        self._cached: tuple[int, np.ndarray] | None = None

    def _order(self, epoch: int) -> np.ndarray:
        """The epoch's permutation: a pure function of (shuffle_seed, epoch), so resumes agree."""
        if self._cached is None or self._cached[0] != epoch:
            order = (np.random.default_rng([self.cursor.shuffle_seed, epoch]).permutation(len(self.rows))
                     if self.shuffle else np.arange(len(self.rows)))
            self._cached = (epoch, order)
        return self._cached[1]

    def next_batch(self, n: int) -> list[Prompt]:
        """The next `n` prompts, wrapping into the next epoch's permutation when one runs out."""
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
