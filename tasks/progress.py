"""One progress line on the terminal of `milepost run` for the stage that is running, with its
rate and ETA, read from the store (the driver follows the stage jobs; it does not run them):

    block 1 run_steps: step 3/8 · 0.41 steps/s · ETA 12 s · reward 0.156
    block 1 start_engines (engine start-up, warm-start, base eval): 42 s · last time 1 min 05 s · ETA 23 s
    block 1 publish (export): 3 s · last time 5 s · ETA 2 s

The run_steps stage's rate is its steps per second since this try started (checkpoint saves and
weight pushes included: they are part of a step's cost); the other stages have no unit of
work to count, so their ETA is the same stage's duration in the block before. Quiet when
stderr is not a terminal (a log file or CI gets the per-stage "done" lines instead).
"""

from __future__ import annotations

import sys
import time
from typing import TextIO

from milepost.core.records import (
    BLOCK_STAGES,
    STEPS_STARTS_DOC,
    Stage,
    StageRecord,
    StageState,
    block_path,
)
from milepost.core.store import CampaignStore
from milepost.tasks.block_summary import human_duration

# What each stage spends its time on, as a user would call it.
STAGE_WORK = {Stage.START_RAY: "Ray start", Stage.START_ENGINES: "engine start-up, warm-start, base eval",
              Stage.RUN_STEPS: "steps, checkpoint saves", Stage.PUBLISH: "export", Stage.EVALUATE: "held-out eval"}


def steps_line(block: int, done: int, total: int, rate: float | None, reward: float | None) -> str:
    """`block 1 run_steps: step 3/8 · 0.41 steps/s · ETA 12 s · reward 0.156`."""
    parts = [f"block {block} {Stage.RUN_STEPS}: step {done}/{total}"]
    if rate:
        parts += [f"{rate:.2f} steps/s", f"ETA {human_duration(max(0, total - done) / rate)}"]
    if reward is not None:
        parts.append(f"reward {reward:.3f}")
    return " · ".join(parts)


def stage_line(block: int, stage: Stage, elapsed_s: float, last_s: float | None) -> str:
    """`block 1 publish (export): 3 s · last time 5 s · ETA 2 s`."""
    parts = [f"block {block} {stage} ({STAGE_WORK.get(stage, stage)}): {human_duration(elapsed_s)}"]
    if last_s is not None:
        parts += [f"last time {human_duration(last_s)}",
                  f"ETA {human_duration(last_s - elapsed_s)}" if elapsed_s < last_s else "longer than last time"]
    return " · ".join(parts)


def _last_duration(store: CampaignStore, block: int, stage: Stage) -> float | None:
    record = store.stage_record(block - 1, stage) if block > 0 else None
    return record.duration_s if record and record.done and record.finished_at else None


def _steps_progress(store: CampaignStore, block: int, steps_per_block: int, record: StageRecord,
                    now: float) -> str:
    """Steps per second of this try: from blocks/N/train_starts.json (when it began, from which
    committed step), so a resumed stage's rate counts only the steps it did."""
    first = block * steps_per_block
    rel = block_path(block, STEPS_STARTS_DOC)
    starts = store.read_json(rel) if store.exists(rel) else []
    started_at, from_step = ((float(starts[-1]["at"]), max(first, int(starts[-1]["from_step"]))) if starts
                             else (float(record.started_at or now), first))
    rows = store.read_metrics(block)
    step = int(rows[-1]["step"]) if rows else first
    rate = (step - from_step) / (now - started_at) if step > from_step and now > started_at else None
    return steps_line(block, max(0, step - first), steps_per_block, rate,
                      rows[-1].get("rollout/reward_mean") if rows else None)


def current_line(store: CampaignStore, block: int, steps_per_block: int, now: float | None = None) -> str | None:
    """The line for the block's running stage; None when none is running."""
    now = time.time() if now is None else now
    for stage in BLOCK_STAGES:
        record = store.stage_record(block, stage)
        if record is None or record.state is not StageState.RUNNING:
            continue
        elapsed = now - float(record.started_at or now)
        if stage is not Stage.RUN_STEPS:
            return stage_line(block, stage, elapsed, _last_duration(store, block, stage))
        return _steps_progress(store, block, steps_per_block, record, now)
    return None


class ProgressLine:
    """Rewrites one terminal line in place; does nothing when `stream` is not a terminal."""

    def __init__(self, stream: TextIO | None = None) -> None:
        self.stream = stream or sys.stderr
        self.enabled = bool(getattr(self.stream, "isatty", lambda: False)())
        self._width = 0

    def show(self, text: str | None) -> None:
        if not self.enabled:
            return
        text = text or ""
        self.stream.write("\r" + text.ljust(self._width))
        self.stream.flush()
        self._width = len(text)

    def clear(self) -> None:
        """Before a log line is printed, so it does not land in the middle of the progress line."""
        if self.enabled and self._width:
            self.stream.write("\r" + " " * self._width + "\r")
            self.stream.flush()
            self._width = 0
