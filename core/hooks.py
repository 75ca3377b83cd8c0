"""Hooks: user functions the loop calls at named moments, to observe, never to steer.

`hooks.on_rollout`, `hooks.on_step_end`, `hooks.on_checkpoint` and `hooks.on_block_end` each
take a list of registered names or import paths, resolved and checked against their Protocol
at start-up. A hook gets the event's data and a read-only `StepContext`; what it returns is
ignored. It runs on the loop's thread, so a slow hook slows the step.
A hook that raises stops the run with a HookError naming it (a user error: not retried; the
campaign resumes from its last checkpoint once the hook is fixed).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import Protocol

from milepost.core.config import HooksConfig
from milepost.core.plugins import PluginError, Registry
from milepost.core.step_context import StepContext
from milepost.core.types import Sample


@dataclass(frozen=True)
class CommittedCheckpoint:
    """A committed checkpoint: its step, folder and the sha256 of the weights it holds."""

    step: int
    path: str
    model_sha256: str


@dataclass(frozen=True)
class BlockInfo:
    """A block whose train steps are done: its number, step range and final weights."""

    block: int
    first_step: int
    last_step: int
    model_sha256: str


class OnRollout(Protocol):
    """After the step's samples are scored, before filters (samples whose reward failed included)."""

    def __call__(self, samples: Sequence[Sample], context: StepContext) -> None: ...


class OnStepEnd(Protocol):
    """After a step: its metrics row (the one metrics.jsonl gets), read-only."""

    def __call__(self, metrics: Mapping[str, object], context: StepContext) -> None: ...


class OnCheckpoint(Protocol):
    """After a checkpoint is committed."""

    def __call__(self, checkpoint: CommittedCheckpoint, context: StepContext) -> None: ...


class OnBlockEnd(Protocol):
    """After the block's last train step (its checkpoint committed), before publish and eval."""

    def __call__(self, block: BlockInfo, context: StepContext) -> None: ...


ON_ROLLOUT: Registry[OnRollout] = Registry("hooks.on_rollout", OnRollout)
ON_STEP_END: Registry[OnStepEnd] = Registry("hooks.on_step_end", OnStepEnd)
ON_CHECKPOINT: Registry[OnCheckpoint] = Registry("hooks.on_checkpoint", OnCheckpoint)
ON_BLOCK_END: Registry[OnBlockEnd] = Registry("hooks.on_block_end", OnBlockEnd)


class HookError(PluginError):
    """A hook raised."""


@dataclass(frozen=True)
class Hooks:
    """The recipe's hooks, resolved; one method per event calls that event's hooks in order."""

    on_rollout: tuple[tuple[str, OnRollout], ...] = ()
    on_step_end: tuple[tuple[str, OnStepEnd], ...] = ()
    on_checkpoint: tuple[tuple[str, OnCheckpoint], ...] = ()
    on_block_end: tuple[tuple[str, OnBlockEnd], ...] = ()

    @classmethod
    def from_config(cls, cfg: HooksConfig) -> Hooks:
        """Resolves every hook now: a bad name or signature fails at start-up."""
        return cls(tuple((s, ON_ROLLOUT.resolve(s)) for s in cfg.on_rollout),
                   tuple((s, ON_STEP_END.resolve(s)) for s in cfg.on_step_end),
                   tuple((s, ON_CHECKPOINT.resolve(s)) for s in cfg.on_checkpoint),
                   tuple((s, ON_BLOCK_END.resolve(s)) for s in cfg.on_block_end))

    def rollout(self, samples: Sequence[Sample], context: StepContext) -> None:
        for spec, fn in self.on_rollout:
            _call("on_rollout", spec, fn, tuple(samples), context)

    def step_end(self, metrics: Mapping[str, object], context: StepContext) -> None:
        for spec, fn in self.on_step_end:
            _call("on_step_end", spec, fn, MappingProxyType(dict(metrics)), context)

    def checkpoint(self, checkpoint: CommittedCheckpoint, context: StepContext) -> None:
        for spec, fn in self.on_checkpoint:
            _call("on_checkpoint", spec, fn, checkpoint, context)

    def block_end(self, block: BlockInfo, context: StepContext) -> None:
        for spec, fn in self.on_block_end:
            _call("on_block_end", spec, fn, block, context)


def _call(event: str, spec: str, hook: Callable[..., None], *args: object) -> None:
    try:
        hook(*args)
    except Exception as e:  # any error of user code names the hook
        raise HookError(f"hooks.{event} `{spec}` raised {type(e).__name__}: {e}; fix the hook, then run "
                        "again: the campaign resumes from its last checkpoint") from e
