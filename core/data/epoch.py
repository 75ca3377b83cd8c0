"""Whether a campaign trained every prompt of its epoch exactly once: the check behind "killed
and resumed with nothing lost" (tests/faults, bench/gpu_arith.py).

It reads only the step metrics the loop writes (`step`, `data/prompt_indices`: the row
indices of the prompts each step trained), so anything holding a campaign's metric rows can
ask it. Sized for one epoch: a run whose data set holds exactly the prompts it trains
(`data.num_train_rows` = steps x prompts per step), as the kill tests set it up.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

PROMPTS_KEY = "data/prompt_indices"


@dataclass(frozen=True)
class EpochCoverage:
    lost: int       # prompts of the epoch never trained
    repeated: int   # extra trainings of a prompt (or prompts from outside the epoch)
    steps_ok: bool  # steps 1..N, each once, one metric row each
    steps: tuple[int, ...]

    @property
    def exactly_once(self) -> bool:
        return self.lost == 0 and self.repeated == 0 and self.steps_ok


def epoch_coverage(rows: Iterable[Mapping[str, Any]], num_steps: int, num_prompts: int) -> EpochCoverage:
    """How the metric `rows` of a campaign cover an epoch of `num_prompts` prompts trained over
    `num_steps` steps."""
    rows = list(rows)
    steps = tuple(int(r["step"]) for r in rows)
    prompts = [int(i) for r in rows for i in r.get(PROMPTS_KEY, [])]
    seen, expected = set(prompts), set(range(num_prompts))
    return EpochCoverage(lost=len(expected - seen), repeated=len(prompts) - len(seen) + len(seen - expected),
                         steps_ok=steps == tuple(range(1, num_steps + 1)), steps=steps)
