"""Reward functions: `fn(response_text, label) -> float`, named in the recipe, checked at start-up."""

from __future__ import annotations

import inspect
import re
from concurrent.futures import ThreadPoolExecutor
from typing import Callable

from milepost.core.plugins import load_object
from milepost.core.rewards_math import gsm8k_reward
from milepost.core.types import Sample

RewardFn = Callable[[str, str], float]


def tiny_arith_reward(response_text: str, label: str) -> float:
    return 1.0 if response_text.strip() == label.strip() else 0.0


_NUMBER = r"-?\$?\d[\d,]*(?:\.\d+)?"


def _normalise_answer(text: str) -> str:
    """Compare answers as written by humans: `$1,234.0` == `1234`."""
    text = text.strip().replace(",", "").replace("$", "").rstrip(".").strip()
    if re.fullmatch(r"-?\d+\.0+", text):
        text = text.split(".")[0]
    return text


def extract_final_answer(text: str) -> str | None:
    """Last \\boxed{...}; else what follows the last `####` / `answer is`; else the last number."""
    boxed = re.findall(r"\\boxed\{([^{}]*)\}", text)
    if boxed:
        return boxed[-1]
    for marker in ("####", "answer is"):
        if marker in text:
            tail = text.rsplit(marker, 1)[1].strip().split("\n")[0]
            first = re.search(_NUMBER, tail)  # "answer is 42 because ..." -> 42
            return first.group(0) if first else tail
    numbers = re.findall(_NUMBER, text)
    return numbers[-1] if numbers else None


def math_final_answer_reward(response_text: str, label: str) -> float:
    answer = extract_final_answer(response_text)
    return 1.0 if answer is not None and _normalise_answer(answer) == _normalise_answer(label) else 0.0


REWARD_FUNCTIONS: dict[str, RewardFn] = {
    "tiny-arith": tiny_arith_reward,
    "math-final-answer": math_final_answer_reward,
    "gsm8k": gsm8k_reward,
}


def resolve_reward_fn(spec: str) -> RewardFn:
    """A registered name, `package.module:function` or `path/to/file.py:function`, checked now
    so a wrong signature fails at start-up, not at the first reward."""
    fn = REWARD_FUNCTIONS.get(spec) or load_object(spec, what="reward.function",
                                                  known=sorted(REWARD_FUNCTIONS))
    if not callable(fn):
        raise ValueError(f"reward.function `{spec}` is not callable; name a function")
    try:
        inspect.signature(fn).bind("response", "label")
    except TypeError as e:
        raise ValueError(f"reward.function `{spec}` must accept (response_text, label): {e}; "
                         "change its signature to fn(response_text: str, label: str) -> float") from None
    return fn


class RewardEvaluator:
    """Scores samples concurrently on a thread pool; order is preserved."""

    def __init__(self, fn: RewardFn, num_workers: int = 2) -> None:
        if num_workers < 1:
            raise ValueError(f"reward.num_workers must be >= 1, got {num_workers}")
        self.fn, self.num_workers = fn, num_workers

    def _one(self, sample: Sample) -> float:
        try:
            return float(self.fn(sample.response_text, sample.label))
        except Exception as e:
            raise RuntimeError(f"reward function failed on sample of prompt {sample.prompt_index} "
                               f"(group {sample.group_index}) "
                               f"(response {sample.response_text!r}): {type(e).__name__}: {e}") from e

    def score(self, samples: list[Sample]) -> list[float]:
        # Slices, not one future per sample: for cheap rewards the futures cost more than the
        # scoring (and contend for the GIL with the rollout's HTTP); a few slices per worker
        # still balance slow, I/O-bound rewards.
        size = max(1, -(-len(samples) // (4 * self.num_workers)))
        slices = [samples[i:i + size] for i in range(0, len(samples), size)]
        with ThreadPoolExecutor(max_workers=self.num_workers) as pool:
            scores = [x for part in pool.map(lambda part: [self._one(s) for s in part], slices) for x in part]
        for s, r in zip(samples, scores):
            s.reward = r
        return scores
