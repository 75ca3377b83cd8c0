"""Prompt datasets (JSONL or Parquet through fsspec) and a deterministic, resumable cursor."""

from __future__ import annotations

import io
import json
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import fsspec
import numpy as np

from milepost.core.config import DataConfig
from milepost.core.errors import UserError
from milepost.core.types import Prompt


class DatasetError(UserError):
    """A dataset the recipe names cannot be used as it is; the message names the row and the fix."""


class DatasetNotFoundError(DatasetError, FileNotFoundError):
    """A user mistake (UserError) that callers catching FileNotFoundError still see."""


@dataclass(frozen=True)
class PromptLimit:
    """The longest prompt (in the policy's tokens) a run can take, and which setting bounds it."""

    tokenizer: Any
    max_tokens: int
    setting: str  # e.g. `rollout.max_prompt_tokens=512`, named in errors


def load_rows(path: str, prompt_key: str = "prompt", label_key: str = "label", *,
              setting: str = "data.train_path", data_cfg: DataConfig | None = None,
              builtin_rows: int | None = None, seed: int = 1,
              prompt_limit: PromptLimit | Callable[[], PromptLimit | None] | None = None) -> list[dict[str, Any]]:
    """Rows of a JSONL or Parquet file (local path or fsspec URL) or a `builtin:` dataset.

    `setting` is the recipe key the path came from, named in errors. Builtin datasets are
    sized by `data_cfg` (or `builtin_rows`, which overrides both splits' row counts). Every
    row must have a non-empty string prompt and a label; with `prompt_limit`, every prompt
    must fit in it (a callable is called only once every row passed: loading a tokenizer
    takes seconds, a malformed row should not wait for it). Errors name the file and the line
    (JSONL) or row (Parquet).
    """
    if path.startswith("builtin:"):
        from milepost.core.data.arith import write_builtin_dataset
        cfg = data_cfg or DataConfig()
        if builtin_rows is not None:
            cfg = cfg.model_copy(update={"num_train_rows": builtin_rows, "num_eval_rows": builtin_rows})
        path = write_builtin_dataset(path, cfg, seed)
    raw = _read(path, setting)
    located = _parse_parquet(raw, path) if path.endswith(".parquet") else _parse_jsonl(raw, path)
    if not located:
        raise DatasetError(f"{setting}: dataset `{path}` has no rows; point {setting} at a file with "
                           "one JSON object per line (or a Parquet table)")
    for where, row in located:
        _check_row(row, f"{path}: {where}", prompt_key, label_key)
    limit = prompt_limit() if callable(prompt_limit) else prompt_limit
    if limit is not None:
        check_prompt_lengths(located, path, prompt_key, limit)
    return [row for _, row in located]


def _read(path: str, setting: str) -> bytes:
    try:
        fs, fs_path = fsspec.core.url_to_fs(path)
    except (ImportError, ValueError) as e:  # unknown protocol, or its package is not installed
        raise DatasetError(f"{setting}: cannot open `{path}`: {e}") from None
    if fs.isdir(fs_path):
        raise DatasetError(f"{setting}: `{path}` is a folder; point it at a JSONL or Parquet file")
    if not fs.isfile(fs_path):
        raise DatasetNotFoundError(f"{setting}: dataset `{path}` does not exist; fix the path in the "
                                   f"recipe or pass --set {setting}=...")
    try:
        with fs.open(fs_path, "rb") as f:
            return f.read()
    except PermissionError as e:
        raise DatasetError(f"{setting}: dataset `{path}` cannot be read ({e.strerror}); check its "
                           "permissions") from None


def _check_row(row: dict[str, Any], where: str, prompt_key: str, label_key: str) -> None:
    for key, setting in ((prompt_key, "data.prompt_key"), (label_key, "data.label_key")):
        if key not in row:
            raise DatasetError(f"{where} has no `{key}` (its keys: {sorted(row)}); set {setting} to the "
                               "dataset's column name, or fix the row")
    prompt = row[prompt_key]
    if not isinstance(prompt, str):
        raise DatasetError(f"{where}: `{prompt_key}` is a {type(prompt).__name__} ({prompt!r:.60}), not a "
                           "string; write the prompt as text")
    if not prompt.strip():
        raise DatasetError(f"{where}: `{prompt_key}` is empty; remove the row or give it a prompt")
    if row[label_key] is None:
        raise DatasetError(f"{where}: `{label_key}` is null; every row needs the label its reward compares "
                           "against")


def check_prompt_lengths(located: list[tuple[str, dict[str, Any]]], path: str, prompt_key: str,
                         limit: PromptLimit) -> None:
    """The first prompt longer than `limit`, named by its line: generated, it would be cut or
    fail the engine mid-campaign."""
    texts = [row[prompt_key] for _, row in located]
    for start in range(0, len(texts), 1024):  # batches: fast tokenizers encode lists in parallel
        batch = texts[start:start + 1024]
        ids = limit.tokenizer(batch, add_special_tokens=False)["input_ids"]
        for offset, tokens in enumerate(ids):
            if len(tokens) > limit.max_tokens:
                where = located[start + offset][0]
                raise DatasetError(f"{path}: {where}: the prompt is {len(tokens)} tokens, longer than "
                                   f"{limit.setting}; shorten or drop the row, or raise "
                                   "rollout.max_prompt_tokens")


def _parse_jsonl(raw: bytes, path: str) -> list[tuple[str, dict[str, Any]]]:
    """(`line N`, row) per non-blank line."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        line_no = raw[:e.start].count(b"\n") + 1
        raise DatasetError(f"{path}: line {line_no} is not UTF-8 text (byte {e.start}); JSONL is UTF-8: "
                           "re-encode the file, or name a .parquet file") from None
    rows = []
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise DatasetError(f"{path}: line {number} is not valid JSON ({e.msg} at column {e.colno}); "
                               "fix or remove it") from None
        if not isinstance(row, dict):
            raise DatasetError(f"{path}: line {number} must be a JSON object like "
                               f'{{"prompt": "...", "label": "..."}}, got a {type(row).__name__}')
        rows.append((f"line {number}", row))
    return rows


def _parse_parquet(raw: bytes, path: str) -> list[tuple[str, dict[str, Any]]]:
    """(`row N`, row), N counted from 0 as Parquet readers show it."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    try:
        rows = pq.read_table(io.BytesIO(raw)).to_pylist()
    except pa.ArrowException as e:
        raise DatasetError(f"{path}: not a readable Parquet file ({e}); rewrite it or use JSONL") from None
    return [(f"row {i}", row) for i, row in enumerate(rows)]


@dataclass
class DataCursor:
    epoch: int
    offset: int
    shuffle_seed: int
    num_rows: int

    def to_dict(self) -> dict[str, int]:
        return asdict(self)

    @classmethod
    def from_dict(cls, doc: dict[str, int]) -> DataCursor:
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
            raise DatasetError("the prompt dataset is empty; point data.train_path at a file with rows")
        if cursor.num_rows != len(rows):
            raise DatasetError(f"the dataset has {len(rows)} rows but the checkpoint's cursor was "
                               f"made for {cursor.num_rows}: the dataset changed under the campaign; "
                               "restore the file the campaign started with, or start a new --campaign")
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
