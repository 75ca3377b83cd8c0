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


def test_resume_from_a_saved_cursor_matches_reading_straight_through():
    rows = _rows(7)  # batches of 3 over 7 rows cross epoch boundaries mid-batch
    full = _source(rows)
    straight = [[p.index for p in full.next_batch(3)] for _ in range(3)]
    first = _source(rows)
    got = [[p.index for p in first.next_batch(3)]]
    resumed = _source(rows, DataCursor.from_dict(json.loads(json.dumps(first.cursor.to_dict()))))
    got += [[p.index for p in resumed.next_batch(3)] for _ in range(2)]
    assert got == straight
    assert resumed.cursor.epoch == 1 and full.cursor.to_dict() == resumed.cursor.to_dict()
    flat = [index for chunk in straight for index in chunk]
    assert sorted(flat[:7]) == list(range(7))  # epoch 0 is a permutation
    assert flat[7:] == [int(i) for i in full._order(1)[:2]]  # then epoch 1 starts from its own order


def test_prompts_carry_row_index_text_label_and_token_ids():
    p = PromptSource(_rows(3), CharTokenizer(), DataCursor(0, 0, 0, 3), shuffle=False).next_batch(2)
    assert [(x.index, x.text, x.label, x.prompt_ids) for x in p] == [
        (0, "0+0=", "0", [ord(c) for c in "0+0="]), (1, "1+0=", "1", [ord(c) for c in "1+0="])]


def test_cursor_for_another_dataset_size_is_refused():
    with pytest.raises(ValueError, match="changed"):
        _source(_rows(5), DataCursor(0, 0, 7, 6))


def test_missing_file_names_the_path_and_the_recipe_key(tmp_path):
    with pytest.raises(ValueError, match="data.eval_path.*nope.jsonl"):
        load_rows(str(tmp_path / "nope.jsonl"), setting="data.eval_path")


def test_fsspec_url_and_builtin_datasets(tmp_path, monkeypatch):
    import fsspec
    with fsspec.open("memory://milepost-test/d.jsonl", "w") as f:
        f.write(json.dumps({"prompt": "1+1=", "label": "2"}) + "\n")
    assert load_rows("memory://milepost-test/d.jsonl") == [{"prompt": "1+1=", "label": "2"}]
    monkeypatch.setenv("MILEPOST_CACHE", str(tmp_path))
    from milepost.core.config import DataConfig
    from milepost.core.data.arith import write_builtin_dataset
    path = write_builtin_dataset("builtin:tiny-arith/eval", DataConfig(num_eval_rows=30), seed=3)
    assert path.startswith(str(tmp_path)) and path == write_builtin_dataset(
        "builtin:tiny-arith/eval", DataConfig(num_eval_rows=30), seed=3)
    assert load_rows("builtin:tiny-arith/eval", data_cfg=DataConfig(num_eval_rows=30), seed=3) == \
        make_rows(30, 3, "eval")
    with pytest.raises(ValueError, match="builtin:tiny-arith/train"):
        write_builtin_dataset("builtin:tiny-arth/train", DataConfig(), seed=3)


def test_tiny_arith_answers_are_correct_sums_of_operands_up_to_99():
    rows = make_rows(2000, seed=2, split="train")
    for r in rows:
        a, b = r["prompt"].rstrip("=").split("+")
        assert 0 <= int(a) <= 99 and 0 <= int(b) <= 99 and int(r["label"]) == int(a) + int(b)
    assert len(make_rows(5000, seed=2, split="eval")) < 1100  # ~10% of the 10,000 pairs
