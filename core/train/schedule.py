"""Learning-rate schedules (no Ray, no torch.distributed: the Megatron worker also runs bare)."""

from __future__ import annotations

import math
from collections.abc import Callable


def lr_lambda(schedule: str, warmup_steps: int, total_steps: int | None) -> Callable[[int], float]:
    """LR multiplier at optimizer step s (0-based): linear warmup to 1 over warmup_steps, then
    constant, or cosine / linear decay to 0 at total_steps."""
    if schedule != "constant" and total_steps is None:
        raise ValueError(f"train.lr_schedule={schedule} needs total_steps")
    decay_steps = max(1, (total_steps or 0) - warmup_steps)  # read by the decaying schedules only

    def mult(s: int) -> float:
        if s < warmup_steps:
            return (s + 1) / warmup_steps
        if schedule == "constant":
            return 1.0
        progress = min(1.0, (s - warmup_steps) / decay_steps)
        return 0.5 * (1.0 + math.cos(math.pi * progress)) if schedule == "cosine" else 1.0 - progress
    return mult
