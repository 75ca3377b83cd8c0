import sys

import pytest

from milepost.core.errors import UserError
from milepost.core.reward import (REWARD_FUNCTIONS, RewardEvaluator, math_final_answer_reward,
                                  resolve_reward_fn, tiny_arith_reward)
from milepost.core.types import Sample


def _sample(i, text, label="5"):
    return Sample(prompt_index=i, group_index=i, prompt_ids=[1], response_ids=[2], engine_logprobs=[0.0],
                  loss_mask=[1], finish_reason="stop", weight_version="0", label=label, response_text=text)


def test_registry_names_resolve_to_the_builtin_functions():
    assert resolve_reward_fn("tiny-arith") is tiny_arith_reward
    assert resolve_reward_fn("math-final-answer") is math_final_answer_reward
    assert set(REWARD_FUNCTIONS) >= {"tiny-arith", "math-final-answer"}


def test_tiny_arith_is_exact_match_of_the_stripped_response():
    assert tiny_arith_reward(" 19 ", "19") == 1.0
    assert tiny_arith_reward("190", "19") == 0.0


@pytest.mark.parametrize("text,label,expected", [
    ("so the answer is 1,234.", "1234", 1.0),
    ("the answer is 42 because 40+2", "42", 1.0),
    ("\\boxed{41} no wait \\boxed{42}", "42", 1.0),
    ("#### 7.0", "7", 1.0),
    ("it costs $15", "15", 1.0),
    ("3 then -4", "-4", 1.0),
    ("3 then 4", "3", 0.0),
    ("no numbers here", "3", 0.0),
])
def test_math_final_answer_matcher(text, label, expected):
    assert math_final_answer_reward(text, label) == expected


def test_reward_import_path_from_a_file(tmp_path):
    (tmp_path / "r.py").write_text("def score(response_text, label):\n    return 0.5\n")
    assert resolve_reward_fn(f"{tmp_path}/r.py:score")("x", "y") == 0.5


def test_reward_module_path(tmp_path, monkeypatch):
    (tmp_path / "my_rewards.py").write_text("def length(response_text, label):\n    return len(response_text)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert resolve_reward_fn("my_rewards:length")("abc", "") == 3
    assert resolve_reward_fn("milepost.core.reward:tiny_arith_reward")("12", "12") == 1.0
    sys.modules.pop("my_rewards", None)


def test_unknown_reward_name_lists_the_registered_ones():
    with pytest.raises(ValueError, match="tiny-arth.*math-final-answer.*tiny-arith"):
        resolve_reward_fn("tiny-arth")


def test_import_error_shows_the_real_cause(tmp_path):
    (tmp_path / "r.py").write_text("import no_such_module_xyz\ndef score(a, b):\n    return 0\n")
    with pytest.raises(ValueError, match="no_such_module_xyz"):
        resolve_reward_fn(f"{tmp_path}/r.py:score")
    with pytest.raises(ValueError, match="no attribute `nope`"):
        resolve_reward_fn("milepost.core.reward:nope")


def test_reward_with_the_wrong_signature_is_refused_at_start_up(tmp_path):
    (tmp_path / "r.py").write_text("def score(only_one):\n    return 0.5\n")
    with pytest.raises(ValueError, match="r.py:score.*must accept"):
        resolve_reward_fn(f"{tmp_path}/r.py:score")


def test_reward_evaluator_keeps_order_and_sets_rewards():
    samples = [_sample(i, "5" if i % 2 else "4") for i in range(9)]
    assert RewardEvaluator(resolve_reward_fn("tiny-arith"), 3).score(samples) == [i % 2 for i in range(9)]
    assert [s.reward for s in samples] == [i % 2 for i in range(9)]


def test_a_reward_that_fails_on_every_sample_stops_the_step_with_its_own_error():
    def boom(response_text, label):
        raise KeyError("bad")
    with pytest.raises(UserError, match=r"`boom` failed on every sample of step 4: KeyError: 'bad' "
                                        r"\(first failure: prompt 3 \(group 3\), response 'x'\)") as info:
        RewardEvaluator(boom, 2).score([_sample(3, "x")], step=4)
    assert isinstance(info.value.__cause__, KeyError)  # the reward's own traceback is kept
