"""The GSM8K-style reward: the final number of a response, compared numerically with the label's."""

from __future__ import annotations

from fractions import Fraction

import pytest

from milepost.core.reward import REWARD_FUNCTIONS, RewardEvaluator, resolve_reward_fn
from milepost.core.rewards_math import extract_answer, gsm8k_reward, label_answer, parse_number
from milepost.core.types import Sample

GSM8K_LABEL = ("Natalia sold 48/2 = <<48/2=24>>24 clips in May.\n"
               "Natalia sold 48+24 = <<48+24=72>>72 clips altogether in April and May.\n#### 72")


@pytest.mark.parametrize("response,label,expected", [
    ("In April 48, in May 24, so \\boxed{72}.", GSM8K_LABEL, 1.0),
    ("48 + 24 = 72 clips. #### 72", GSM8K_LABEL, 1.0),
    ("The answer is 72 because 48 + 24 = 72", GSM8K_LABEL, 1.0),
    ("48 + 24 = 72", GSM8K_LABEL, 1.0),               # no marker: the last number
    ("72 is wrong, it is 70", GSM8K_LABEL, 0.0),
    ("\\boxed{71} no wait, \\boxed{72}", "72", 1.0),  # the last boxed answer counts
    ("\\boxed{72} hmm 5", "72", 1.0),                 # boxed wins over a later stray number
    ("\\boxed{\\frac{3}{4}}", "0.75", 1.0),           # nested braces, a LaTeX fraction
    ("\\boxed{\\dfrac{1}{3}}", "0.3333", 0.0),        # exact comparison: 1/3 is not 0.3333
    ("It costs $1,234.50.", "#### 1234.5", 1.0),
    ("answer: 7.0 apples", "7", 1.0),
    ("so 50% of them", "50", 1.0),
    ("-3", "-3", 1.0),
    ("3", "-3", 0.0),
    ("no numbers at all", "3", 0.0),
    ("\\boxed{}", "3", 0.0),
])
def test_gsm8k_reward(response: str, label: str, expected: float) -> None:
    assert gsm8k_reward(response, label) == expected


def test_numbers_parse_exactly() -> None:
    assert parse_number("$1,000,000") == 1_000_000
    assert parse_number(".5") == Fraction(1, 2)
    assert parse_number("\\frac{2}{6}") == Fraction(1, 3)
    assert parse_number("3 / 4 cups") == Fraction(3, 4)
    assert parse_number("1/0") is None
    assert extract_answer("first 3, answer is 4, then 5") == 4
    assert label_answer(GSM8K_LABEL) == 72


def test_a_label_without_a_number_names_the_fix() -> None:
    with pytest.raises(ValueError, match="label_key must name the answer column"):
        gsm8k_reward("42", "Natalia sold clips.")


def test_registered_as_gsm8k_and_scores_samples() -> None:
    assert REWARD_FUNCTIONS["gsm8k"] is gsm8k_reward and resolve_reward_fn("gsm8k") is gsm8k_reward
    samples = [Sample(prompt_index=i, group_index=i, prompt_ids=[1], response_ids=[2], engine_logprobs=[0.0],
                      loss_mask=[1], finish_reason="stop", weight_version="0", label=GSM8K_LABEL,
                      response_text=text) for i, text in enumerate(["\\boxed{72}", "\\boxed{71}", "#### 72.00"])]
    assert RewardEvaluator(resolve_reward_fn("gsm8k"), 2).score(samples) == [1.0, 0.0, 1.0]
