"""core/train/batch.py `collate`: the padded tensors of a micro-batch, checked row by row
against the layout its module docstring states."""

from __future__ import annotations

import random

import pytest
import torch

from milepost.core.train.batch import collate
from milepost.core.types import Sample

PAD = 7


def sample(rng: random.Random, i: int, prompt: int, response: int) -> Sample:
    return Sample(prompt_index=i, group_index=i // 2, prompt_ids=[rng.randrange(10, 999) for _ in range(prompt)],
                  response_ids=[rng.randrange(10, 999) for _ in range(response)],
                  engine_logprobs=[-rng.random() * 5 for _ in range(response)],
                  loss_mask=[rng.random() < 0.8 for _ in range(response)], finish_reason="stop",
                  weight_version="0", label="", advantage=rng.uniform(-2, 2))


def test_rows_follow_the_documented_layout() -> None:
    rng = random.Random(0)
    samples = [sample(rng, 0, 5, 9), sample(rng, 1, 1, 3), sample(rng, 2, 12, 0), sample(rng, 3, 3, 14)]
    got = collate(samples, PAD)
    width, t_max = 17, 14
    assert {k: tuple(v.shape) for k, v in got.items()} == {
        **dict.fromkeys(("input_ids", "attention_mask", "position_ids"), (4, width)),
        **dict.fromkeys(("logit_index", "target_ids", "response_mask", "loss_mask", "engine_logprobs",
                         "advantages"), (4, t_max))}
    for k in ("input_ids", "attention_mask", "position_ids", "logit_index", "target_ids"):
        assert got[k].dtype == torch.long, k
    for i, s in enumerate(samples):
        p, n = len(s.prompt_ids), len(s.response_ids)
        tokens = s.prompt_ids + s.response_ids
        assert got["input_ids"][i].tolist() == tokens + [PAD] * (width - p - n)
        assert got["attention_mask"][i].tolist() == [1] * (p + n) + [0] * (width - p - n)
        assert got["position_ids"][i].tolist() == list(range(width))
        assert got["logit_index"][i].tolist() == list(range(p - 1, p - 1 + n)) + [0] * (t_max - n)
        assert got["target_ids"][i].tolist() == s.response_ids + [PAD] * (t_max - n)
        assert got["response_mask"][i].tolist() == [1.0] * n + [0.0] * (t_max - n)
        assert got["loss_mask"][i].tolist() == [float(m) for m in s.loss_mask] + [0.0] * (t_max - n)
        expected_lp = torch.tensor(s.engine_logprobs + [0.0] * (t_max - n), dtype=torch.float32)
        assert torch.equal(got["engine_logprobs"][i], expected_lp)  # rounded to float32 as torch rounds
        expected_adv = torch.tensor([s.advantage] * n + [0.0] * (t_max - n), dtype=torch.float32)
        assert torch.equal(got["advantages"][i], expected_adv)


def test_bad_samples_are_refused_by_name() -> None:
    rng = random.Random(1)
    with pytest.raises(ValueError, match="at least one"):
        collate([], PAD)
    s = sample(rng, 4, 0, 3)
    with pytest.raises(ValueError, match="prompt 4 has an empty prompt"):
        collate([s], PAD)
    s = sample(rng, 5, 2, 3)
    s.loss_mask.pop()
    with pytest.raises(ValueError, match="prompt 5: response_ids"):
        collate([s], PAD)
