"""The warm-start's batches (core/model/warmstart.batch) are encoded through a byte table, not
the tokenizer; they must be exactly what the tokenizer gives: the CPU recipes' numbers are
bitwise the tokenizer-encoded warm-start's."""

from __future__ import annotations

import random

import torch

from milepost.core.model import tiny
from milepost.core.model.warmstart import batch


def _by_tokenizer(rows, targets, tokenizer):
    """The reference: each row through the tokenizer, right-padded, the answer and eos masked in."""
    prompts = tokenizer([r["prompt"] for r in rows], add_special_tokens=False)["input_ids"]
    answers = tokenizer(targets, add_special_tokens=False)["input_ids"]
    ids = [p + a + [tokenizer.eos_token_id] for p, a in zip(prompts, answers)]
    masks = [[0] * len(p) + [1] * (len(a) + 1) for p, a in zip(prompts, answers)]
    width = max(map(len, ids))
    x = torch.tensor([r + [tokenizer.pad_token_id] * (width - len(r)) for r in ids])
    m = torch.tensor([r + [0] * (width - len(r)) for r in masks], dtype=torch.float32)
    return x, m


def test_batches_match_the_tokenizer_on_sums_of_every_width_and_both_answer_forms():
    tokenizer = tiny.build_tokenizer()
    rng = random.Random(0)
    rows, targets = [], []
    for _ in range(300):
        a, b = rng.randint(0, 999), rng.randint(0, 9)
        rows.append({"prompt": f"{a}+{b}="})
        targets.append(str(a + b) + ("+0" if rng.random() < 0.3 else ""))
    for size in (1, 7, 300):
        x, m = batch(rows[:size], targets[:size], tokenizer)
        want_x, want_m = _by_tokenizer(rows[:size], targets[:size], tokenizer)
        assert x.dtype == want_x.dtype and m.dtype == want_m.dtype
        assert torch.equal(x, want_x) and torch.equal(m, want_m)


def test_a_character_outside_the_vocabulary_gets_the_tokenizers_unknown_id():
    tokenizer = tiny.build_tokenizer()
    rows, targets = [{"prompt": "12*3="}, {"prompt": "1+1="}], ["36", "2"]
    x, m = batch(rows, targets, tokenizer)
    want_x, want_m = _by_tokenizer(rows, targets, tokenizer)
    assert torch.equal(x, want_x) and torch.equal(m, want_m)


def test_a_batch_padded_to_a_fixed_length_has_the_same_rows_and_masks_only_padding_out():
    """The compiled warm-start pads every batch to one length (one compiled shape); the extra
    columns are padding the loss ignores, and the model is causal, so the loss is unchanged."""
    tokenizer = tiny.build_tokenizer()
    rows = [{"prompt": "12+3="}, {"prompt": "999+999="}]
    targets = ["15", "1998"]
    x, m = batch(rows, targets, tokenizer)
    padded_x, padded_m = batch(rows, targets, tokenizer, length=x.shape[1] + 5)
    assert padded_x.shape == (2, x.shape[1] + 5)
    assert torch.equal(padded_x[:, :x.shape[1]], x) and torch.equal(padded_m[:, :x.shape[1]], m)
    assert (padded_x[:, x.shape[1]:] == tokenizer.pad_token_id).all() and padded_m[:, x.shape[1]:].sum() == 0
    assert torch.equal(batch(rows, targets, tokenizer, length=2)[0], x)  # never shorter than the rows
