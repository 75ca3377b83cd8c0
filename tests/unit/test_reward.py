import sys

import pytest

from milepost.core.errors import UserError
from milepost.core.reward import (
    REWARD_FAILED,
    REWARD_FUNCTIONS,
    RewardEvaluator,
    math_final_answer_reward,
    resolve_reward_fn,
    split_failed,
    tiny_arith_reward,
)
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


# --- a reward that fails on some samples: marked, counted, logged once, left out of training ----

def _group(rewards_by_text, group=0):
    return [Sample(prompt_index=group, group_index=group, prompt_ids=[1], response_ids=[2, 3],
                   engine_logprobs=[0.0, 0.0], loss_mask=[1, 1], finish_reason="stop", weight_version="0",
                   label="5", response_text=text) for text in rewards_by_text]


def _flaky(response_text, label):
    """A user's reward with real bugs: it parses what it should not and returns what it should not."""
    if response_text == "boom":
        raise RuntimeError("boom")
    return {"nan": float("nan"), "inf": float("inf"), "none": None, "str": "1.0",
            "list": [1.0]}.get(response_text, 1.0 if response_text == label else 0.0)


@pytest.mark.parametrize("text,reason", [
    ("boom", "RuntimeError: boom"),
    ("nan", "returned nan, not a finite number"),
    ("inf", "returned inf, not a finite number"),
    ("none", "returned None, not a number"),
    ("str", "returned '1.0', not a number"),
    ("list", "returned a list ([1.0]), not a number"),
])
def test_a_sample_whose_reward_fails_is_marked_and_the_rest_are_scored(text, reason):
    samples = _group(["5", text, "4"])
    assert RewardEvaluator(_flaky, 2).score(samples, step=3) == [1.0, 0.0, 0.0]
    assert samples[1].extra[REWARD_FAILED] == reason
    assert REWARD_FAILED not in samples[0].extra and REWARD_FAILED not in samples[2].extra
    kept, metrics = split_failed(samples)
    assert kept == [samples[0], samples[2]] and metrics == {"rollout/reward_failed": 1.0}


def test_a_failed_reward_does_not_move_its_group_baseline():
    """The group keeps the advantages it would have had without the failed sample; a 0 in its
    place would have lowered the baseline and rewarded the wrong answer."""
    from milepost.core.loop import assign_advantages
    with_failure = _group(["5", "4", "boom", "5"])
    RewardEvaluator(_flaky, 2).score(with_failure, step=1)
    kept, _ = split_failed(with_failure)
    assign_advantages(kept, "grpo")
    clean = _group(["5", "4", "5"])
    RewardEvaluator(_flaky, 2).score(clean, step=1)
    assign_advantages(clean, "grpo")
    assert [s.advantage for s in kept] == pytest.approx([s.advantage for s in clean])
    assert kept[1].advantage < 0 < kept[0].advantage
    as_zero = _group(["5", "4", "4", "5"])  # what reward 0 would have done: the wrong answer gains
    RewardEvaluator(_flaky, 2).score(as_zero, step=1)
    assign_advantages(as_zero, "grpo")
    assert as_zero[1].advantage != pytest.approx(kept[1].advantage)


def test_each_distinct_reward_failure_is_logged_once_with_its_own_message(caplog):
    evaluator = RewardEvaluator(_flaky, 2)
    with caplog.at_level("WARNING", logger="milepost.core.reward"):
        for step in (1, 2):
            evaluator.score(_group(["5", "boom", "boom", "nan"]), step=step)
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2, lines  # boom once, nan once, over both steps
    assert "reward function `_flaky` failed on 3 of 4 samples of step 1" in lines[0]
    assert "RuntimeError: boom on prompt 0 (group 0), response 'boom'" in lines[0]
    assert "returned nan, not a finite number" in lines[1]


def test_a_whole_step_of_failed_rewards_reaches_the_trainer_as_the_user_error():
    """Through the rollout thread: the trainer's error carries the UserError, which the stage
    runner reads (errors.user_error_in) to record `error_kind: user` and not retry."""
    from milepost.core.data.source import DataCursor, PromptSource
    from milepost.core.errors import root_error_line, user_error_in
    from milepost.core.rollout_ahead import RolloutAhead, RolloutError

    evaluator = RewardEvaluator(_flaky, 2)

    def generate(index, prompts):
        samples = [s for p in prompts for s in _group(["boom", "boom"], group=p.index)]
        evaluator.score(samples, step=index + 1)
        return samples

    rows = [{"prompt": f"{i}+0=", "label": str(i)} for i in range(4)]
    ahead = RolloutAhead(PromptSource(rows, None, DataCursor(0, 0, 0, 4), shuffle=False), generate,
                         prompts_per_step=2, max_staleness=0, policy_version=0, next_chunk=0)
    ahead.start(limit=1)
    try:
        with pytest.raises(RolloutError) as info:
            ahead.take(0, timeout_s=30)
    finally:
        ahead.stop(timeout_s=5)
    error = user_error_in(info.value)
    assert isinstance(error, UserError)
    assert root_error_line(info.value).startswith(
        "RewardFailedError: reward function `_flaky` failed on every sample of step 1: RuntimeError: boom "
        "(first failure: prompt 0 (group 0), response 'boom')")
