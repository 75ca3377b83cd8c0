import pytest

from milepost.core.loop import assign_advantages
from milepost.core.types import Sample


def _sample(group, reward):
    return Sample(prompt_index=group, group_index=group, prompt_ids=[1], response_ids=[2],
                  engine_logprobs=[0.0], loss_mask=[1], finish_reason="stop", weight_version="0",
                  label="", reward=reward)


def test_grpo_advantages_are_normalised_within_each_group_even_when_groups_are_ragged():
    samples = [_sample(0, 1.0), _sample(0, 0.0), _sample(1, 1.0), _sample(1, 0.0), _sample(1, 0.0)]
    assign_advantages(samples, "grpo")
    # group 0: mean 0.5, std 0.5 → ±1; group 1: mean 1/3, std sqrt(2)/3 → 1.414, -0.707, -0.707
    assert [round(s.advantage, 3) for s in samples] == [1.0, -1.0, 1.414, -0.707, -0.707]


def test_reinforce_pp_normalises_over_the_whole_batch():
    samples = [_sample(0, 1.0), _sample(0, 1.0), _sample(1, 0.0), _sample(1, 0.0)]
    assign_advantages(samples, "reinforce_pp")
    assert [s.advantage for s in samples] == pytest.approx([1.0, 1.0, -1.0, -1.0], abs=1e-4)


def test_rloo_on_groups_that_filters_left_with_one_sample_gives_them_zero_and_counts_them():
    samples = [_sample(0, 1.0), _sample(1, 1.0), _sample(1, 0.0), _sample(2, 0.0)]
    metrics = assign_advantages(samples, "rloo")
    assert [s.advantage for s in samples] == pytest.approx([0.0, 1.0, -1.0, 0.0])
    assert metrics == {"algo/single_sample_groups": 2.0}
