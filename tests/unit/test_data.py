import json

import pytest

from milepost.core.data.arith import make_rows
from milepost.core.data.source import DataCursor, PromptSource, load_rows


class CharTokenizer:
    def encode(self, text, add_special_tokens=False):
        return [ord(c) for c in text]


def _source(rows, cursor=None):
    return PromptSource(rows, CharTokenizer(), cursor or DataCursor(0, 0, 7, len(rows)), shuffle=True)


def _rows(n):
    return [{"prompt": f"{i}+0=", "label": str(i)} for i in range(n)]


def test_tiny_arith_eval_pairs_never_appear_in_train():
    train = {r["prompt"] for r in make_rows(5000, seed=1, split="train")}
    evals = {r["prompt"] for r in make_rows(200, seed=1, split="eval")}
    assert evals and not (train & evals)
    assert make_rows(10, 1, "train") == make_rows(10, 1, "train")


def test_cursor_resume_neither_skips_nor_repeats_across_an_epoch_boundary():
    rows = _rows(10)
    straight = _source(rows)
    expected = [p.index for _ in range(5) for p in straight.next_batch(4)]
    first = _source(rows)
    got = [p.index for _ in range(2) for p in first.next_batch(4)]
    saved = json.loads(json.dumps(first.cursor.to_dict()))
    resumed = _source(rows, DataCursor.from_dict(saved))
    got += [p.index for _ in range(3) for p in resumed.next_batch(4)]
    assert got == expected
    assert sorted(expected[:10]) == list(range(10))  # each epoch is a permutation


def test_jsonl_and_parquet_load_the_same_rows(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq
    rows = _rows(3)
    (tmp_path / "d.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "d.parquet")
    assert load_rows(str(tmp_path / "d.jsonl")) == rows == load_rows(str(tmp_path / "d.parquet"))


def test_bad_json_line_names_the_line(tmp_path):
    (tmp_path / "d.jsonl").write_text('{"prompt": "a", "label": "b"}\n{oops\n')
    with pytest.raises(ValueError, match="line 2"):
        load_rows(str(tmp_path / "d.jsonl"))


def test_missing_key_names_the_key_and_the_setting(tmp_path):
    (tmp_path / "d.jsonl").write_text('{"question": "a", "label": "b"}\n')
    with pytest.raises(ValueError, match="no `prompt`.*data.prompt_key"):
        load_rows(str(tmp_path / "d.jsonl"))
