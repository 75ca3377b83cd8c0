"""Stages that survive preemption and timeouts.

When Slurm preempts a job or its time runs out, submitit delivers USR2 to the task,
calls the task's `checkpoint()` and requeues the job (`scontrol requeue`; locally, the
controller restarts it). The requeued job calls the same object again with the same
arguments. A milepost stage keeps no state worth pickling: its truth is the campaign
store, and every stage is idempotent, so being called again *is* resuming.

Two ways in:
    class Train(CheckpointableStage):
        def __call__(self, campaign_url: str, block: int) -> dict: ...

    executor.submit(requeueable(train_stage), campaign_url, block)
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import submitit
from submitit.core.utils import DelayedSubmission


class CheckpointableStage(submitit.helpers.Checkpointable):
    """Base class of a stage that is requeued, not failed, on preemption or timeout.

    Subclasses implement `__call__` (idempotent: it reads its store first) and may
    override `on_interrupt` to flush something before the process is stopped.
    """

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError(f"{type(self).__name__} must implement __call__")

    def on_interrupt(self) -> None:
        """Called in the signal handler, just before the job is requeued. Keep it short:
        Slurm kills the job `signal_delay_s` (90 s) after the signal at the latest."""

    def checkpoint(self, *args: Any, **kwargs: Any) -> DelayedSubmission:
        self.on_interrupt()
        return DelayedSubmission(self, *args, **kwargs)


class Requeueable(CheckpointableStage):
    """Wraps an idempotent function so that preemption requeues it instead of failing it."""

    def __init__(self, fn: Callable[..., Any]) -> None:
        self.fn = fn
        self.__name__ = getattr(fn, "__name__", type(fn).__name__)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.fn(*args, **kwargs)


def requeueable(fn: Callable[..., Any]) -> Requeueable:
    return Requeueable(fn)


def restart_count() -> int:
    """How many times this job was requeued so far (0 on its first run)."""
    # Slurm counts requeues; submitit's local controller restarts in place and does not.
    return int(os.environ.get("SLURM_RESTART_COUNT", "0"))
