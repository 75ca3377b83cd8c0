"""TensorBoard sink: event files in one folder under the campaign store, written by
torch's SummaryWriter (tensorboard's own event writer) and read back by tensorboard's
EventAccumulator. Each process that writes adds its own event file to the folder; TensorBoard
reads the folder as one run."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from milepost.core.metrics.sinks import Held


class TensorBoardSink:
    name = "tensorboard"

    def __init__(self, log_dir: str) -> None:
        self.log_dir = log_dir
        self._writer: Any = None  # opened at the first write: a stage with nothing new adds no file

    def held(self) -> Held:
        return read_scalars_held(self.log_dir)

    def write(self, step: int, scalars: Mapping[str, float]) -> None:
        if self._writer is None:
            from torch.utils.tensorboard import SummaryWriter

            # Flushed by publish, not by timer or queue size: a step is durable once its
            # checkpoint is, and never half-written by a background flush in between.
            self._writer = SummaryWriter(self.log_dir, max_queue=1_000_000, flush_secs=10**9)
        for tag, value in scalars.items():
            self._writer.add_scalar(tag, value, global_step=step)

    def flush(self) -> None:
        if self._writer is not None:
            self._writer.flush()

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None


def read_scalars(log_dir: str) -> dict[str, list[tuple[int, float]]]:
    """Every scalar event in `log_dir`, by tag, as (step, value) in file order; nothing is
    purged or sampled, so a step written twice shows twice."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    if not os.path.isdir(log_dir):
        return {}
    acc = EventAccumulator(log_dir, size_guidance={"scalars": 0}, purge_orphaned_data=False)
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def read_scalars_held(log_dir: str) -> Held:
    held: Held = {}
    for tag, events in read_scalars(log_dir).items():
        for step, _ in events:
            held.setdefault(step, set()).add(tag)
    return held
