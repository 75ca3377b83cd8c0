"""What a plugin may know about the step it runs in: a few read-only numbers, never the recipe."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class StepContext:
    """The step being trained (`step`, 1-based over the campaign), the policy version its
    samples are trained from, the block's last step and the campaign's seed. Frozen: a plugin
    reads it and cannot steer the loop through it."""

    step: int
    policy_version: int
    last_step: int
    seed: int
