import pytest

from milepost.core.config import FilterConfig
from milepost.core.filters import filter_groups
from milepost.core.reward import RewardEvaluator, math_final_answer_reward, resolve_reward_fn
from milepost.core.types import Sample


def _sample(group, reward, n_tokens=2):
    return Sample(prompt_index=group, group_index=group, prompt_ids=[1], response_ids=[2] * n_tokens,
                  engine_logprobs=[0.0] * n_tokens, loss_mask=[1] * n_tokens, finish_reason="stop",
                  weight_version="0", label="5", reward=reward)


@pytest.mark.parametrize("text,label,expected", [
    ("so the answer is 1,234.", "1234", 1.0),
    ("\\boxed{42}", "42", 1.0),
    ("#### 7.0", "7", 1.0),
    ("3 then 4", "4", 1.0),
    ("3 then 4", "3", 0.0),
])
def test_math_final_answer_matcher(text, label, expected):
    assert math_final_answer_reward(text, label) == expected


def test_reward_import_path_from_a_file(tmp_path):
    (tmp_path / "r.py").write_text("def score(response_text, label):\n    return 0.5\n")
    assert resolve_reward_fn(f"{tmp_path}/r.py:score")("x", "y") == 0.5


def test_reward_module_path():
    assert resolve_reward_fn("milepost.core.reward:tiny_arith_reward")("12", "12") == 1.0


def test_unknown_reward_name_lists_the_registered_ones():
    with pytest.raises(ValueError, match="tiny-arith"):
        resolve_reward_fn("tiny-arth")


def test_reward_with_the_wrong_signature_is_refused_at_start_up(tmp_path):
    (tmp_path / "r.py").write_text("def score(only_one):\n    return 0.5\n")
    with pytest.raises(ValueError, match="must accept"):
        resolve_reward_fn(f"{tmp_path}/r.py:score")


def test_reward_evaluator_keeps_order_and_sets_rewards():
    samples = [_sample(i, 0.0) for i in range(5)]
    for i, s in enumerate(samples):
        s.response_text = "5" if i % 2 else "4"
    assert RewardEvaluator(resolve_reward_fn("tiny-arith"), 3).score(samples) == [0, 1, 0, 1, 0]


def test_filter_drops_zero_variance_groups_and_long_samples():
    samples = [_sample(0, 1.0), _sample(0, 1.0), _sample(1, 0.0), _sample(1, 1.0, n_tokens=9)]
    kept, metrics = filter_groups(samples, FilterConfig(max_response_tokens=4))
    assert kept == [samples[2]]
    assert metrics["filter/dropped_zero_variance_groups"] == 1.0
    assert metrics["filter/dropped_length"] == 1.0
