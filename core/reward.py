"""Reward functions: `fn(response_text, label) -> float`, named in the recipe, checked at start-up."""

from __future__ import annotations

import logging
import math
import re
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Protocol

from milepost.core.data.arith import either_form_correct
from milepost.core.errors import UserError
from milepost.core.plugins import Registry
from milepost.core.rewards_math import gsm8k_reward
from milepost.core.types import Sample


class RewardFn(Protocol):
    """`reward.function`: the reward of one response against its dataset label."""

    def __call__(self, response_text: str, label: str) -> float: ...


REWARD_FUNCTIONS: Registry[RewardFn] = Registry("reward.function", RewardFn)

log = logging.getLogger(__name__)

# Where a sample whose reward could not be computed carries the reason (see RewardEvaluator).
REWARD_FAILED = "reward_failed"


@REWARD_FUNCTIONS.register("tiny-arith")
def tiny_arith_reward(response_text: str, label: str) -> float:
    return 1.0 if response_text.strip() == label.strip() else 0.0


@REWARD_FUNCTIONS.register("arith-value")
def arith_value_reward(response_text: str, label: str) -> float:
    """1.0 when the answer's value is the label's, in either form (`125` or `125+0`): the
    form earns nothing, only the arithmetic does (gpu-arith)."""
    return 1.0 if either_form_correct(response_text, label) else 0.0


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


@REWARD_FUNCTIONS.register("math-final-answer")
def math_final_answer_reward(response_text: str, label: str) -> float:
    answer = extract_final_answer(response_text)
    return 1.0 if answer is not None and _normalise_answer(answer) == _normalise_answer(label) else 0.0


REWARD_FUNCTIONS.register("gsm8k")(gsm8k_reward)


def resolve_reward_fn(spec: str) -> RewardFn:
    """A registered name, `package.module:function` or `path/to/file.py:function`, checked now
    so a wrong signature fails at start-up, not at the first reward."""
    return REWARD_FUNCTIONS.resolve(spec)


@dataclass(frozen=True)
class RewardFailure:
    """Why one sample has no reward: the function raised (`error`) or returned no finite number."""

    message: str
    error: BaseException | None = None


def reward_value(value: Any) -> float | str:
    """`value` as a reward, or why it is not one. bool counts (True = 1.0); strings do not,
    even numeric ones: a reward returning "1" is a bug to surface, not to guess around."""
    if value is None or isinstance(value, (str, bytes)):
        return f"returned {value!r:.80}, not a number"
    try:
        number = float(value)
    except Exception:  # noqa: BLE001 - TypeError, ValueError, or a tensor's own RuntimeError
        return f"returned a {type(value).__name__} ({value!r:.80}), not a number"
    if not math.isfinite(number):
        return f"returned {number}, not a finite number"
    return number


class RewardFailedError(UserError):
    """A reward function failed on every sample of a step: nothing is left to learn from, and
    running it again gives the same failure."""


class RewardEvaluator:
    """Scores samples concurrently on a thread pool; order is preserved.

    A sample whose reward raises or is not a finite number is *marked* rather than given a
    made-up reward: `sample.extra["reward_failed"]` holds the reason and `sample.reward` is 0.0
    only as a placeholder. The loop leaves marked samples out of training (`split_failed`
    before advantages), because a 0 would tell GRPO that the response was wrong, shifting its
    group's baseline and pushing the policy away from answers the reward merely could not
    score; the rest of the group keeps its own baseline. Each distinct failure is logged once
    with the reward's own message; the count is the step's `rollout/reward_failed`. When every
    sample of a batch fails, the reward function is broken, not the samples: `score` raises
    RewardFailedError (a UserError: not retried) carrying the reward's first error.
    """

    MAX_LOGGED = 20  # distinct failure messages logged; later ones are only counted

    def __init__(self, fn: RewardFn, num_workers: int = 2, name: str | None = None) -> None:
        if num_workers < 1:
            raise UserError(f"reward.num_workers must be >= 1, got {num_workers}")
        self.fn, self.num_workers = fn, num_workers
        self.name = name or getattr(fn, "__name__", type(fn).__name__)
        self._logged: set[str] = set()

    def _one(self, sample: Sample) -> float | RewardFailure:
        try:
            value = self.fn(sample.response_text, sample.label)
        except Exception as e:  # noqa: BLE001 - any error of user code marks the sample
            return RewardFailure(f"{type(e).__name__}: {e}", e)
        checked = reward_value(value)
        return checked if isinstance(checked, float) else RewardFailure(checked)

    def score(self, samples: list[Sample], step: int | None = None) -> list[float]:
        """Sets `sample.reward` (and marks failed samples); returns the rewards in order, 0.0
        for a failed sample. `step` only names the batch in messages."""
        # Slices, not one future per sample: for cheap rewards the futures cost more than the
        # scoring (and contend for the GIL with the rollout's HTTP); a few slices per worker
        # still balance slow, I/O-bound rewards.
        size = max(1, -(-len(samples) // (4 * self.num_workers)))
        slices = [samples[i:i + size] for i in range(0, len(samples), size)]
        with ThreadPoolExecutor(max_workers=self.num_workers) as pool:
            results = [x for part in pool.map(lambda part: [self._one(s) for s in part], slices) for x in part]
        failed = []
        for s, result in zip(samples, results):
            if isinstance(result, RewardFailure):
                s.reward = 0.0
                s.extra[REWARD_FAILED] = result.message
                failed.append((s, result))
            else:
                s.reward = result
                s.extra.pop(REWARD_FAILED, None)
        if failed:
            self._report(failed, len(samples), step)
        return [s.reward for s in samples]

    def _report(self, failed: list[tuple[Sample, RewardFailure]], total: int, step: int | None) -> None:
        batch = f"step {step}" if step is not None else "the batch"
        first_sample, first = failed[0]
        where = (f"prompt {first_sample.prompt_index} (group {first_sample.group_index}), "
                 f"response {first_sample.response_text[:200]!r}")
        if len(failed) == total:
            raise RewardFailedError(
                f"reward function `{self.name}` failed on every sample of {batch}: {first.message} "
                f"(first failure: {where}); fix the function so it returns a finite number for every "
                "(response_text, label), then run again: the campaign resumes from its last checkpoint"
            ) from first.error
        for s, failure in failed:
            if failure.message not in self._logged and len(self._logged) < self.MAX_LOGGED:
                self._logged.add(failure.message)
                log.warning("reward function `%s` failed on %d of %d samples of %s; they are left out of "
                            "training and counted in rollout/reward_failed. %s on prompt %d (group %d), "
                            "response %r", self.name, len(failed), total, batch, failure.message,
                            s.prompt_index, s.group_index, s.response_text[:200])


def split_failed(samples: list[Sample]) -> tuple[list[Sample], dict[str, float]]:
    """The samples that have a reward, and `rollout/reward_failed`: how many were left out."""
    kept = [s for s in samples if REWARD_FAILED not in s.extra]
    return kept, {"rollout/reward_failed": float(len(samples) - len(kept))}
