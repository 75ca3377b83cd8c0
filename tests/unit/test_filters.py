from milepost.core.config import FilterConfig
from milepost.core.filters import filter_groups
from milepost.core.types import Sample


def _sample(group, reward, n_tokens=2):
    return Sample(prompt_index=group, group_index=group, prompt_ids=[1], response_ids=[2] * n_tokens,
                  engine_logprobs=[0.0] * n_tokens, loss_mask=[1] * n_tokens, finish_reason="stop",
                  weight_version="0", label="5", reward=reward)


def test_zero_variance_groups_are_dropped_whole():
    samples = [_sample(0, 1.0), _sample(0, 1.0), _sample(1, 0.0), _sample(1, 1.0), _sample(2, 0.0)]
    kept, metrics = filter_groups(samples, FilterConfig())
    assert kept == samples[2:4]
    assert metrics == {"filter/dropped_zero_variance_groups": 2.0, "filter/dropped_length": 0.0,
                       "filter/kept": 2.0}


def test_zero_variance_groups_are_kept_when_disabled():
    samples = [_sample(0, 1.0), _sample(0, 1.0)]
    kept, metrics = filter_groups(samples, FilterConfig(drop_zero_variance_groups=False))
    assert kept == samples and metrics["filter/dropped_zero_variance_groups"] == 0.0


def test_length_limits_are_inclusive():
    samples = [_sample(0, 0.0, 1), _sample(0, 1.0, 2), _sample(0, 0.0, 4), _sample(0, 1.0, 5)]
    kept, metrics = filter_groups(samples, FilterConfig(min_response_tokens=2, max_response_tokens=4))
    assert kept == samples[1:3]
    assert metrics["filter/dropped_length"] == 2.0 and metrics["filter/kept"] == 2.0


def test_filter_drops_zero_variance_groups_and_long_samples():
    samples = [_sample(0, 1.0), _sample(0, 1.0), _sample(1, 0.0), _sample(1, 1.0, n_tokens=9)]
    kept, metrics = filter_groups(samples, FilterConfig(max_response_tokens=4))
    assert kept == [samples[2]]
    assert metrics["filter/dropped_zero_variance_groups"] == 1.0
    assert metrics["filter/dropped_length"] == 1.0
