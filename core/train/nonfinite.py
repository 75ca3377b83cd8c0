"""Non-finite steps and weights: the rules both train backends (torch, megatron) follow.

- A step is skipped when any rank's loss on any micro-batch is NaN/inf, or the gradient
  (after the data-parallel reduction) holds a NaN/inf. Ranks agree through one all-reduce
  (MAX) of a 0/1 flag, so every rank skips or every rank steps: replicas stay identical and
  no rank waits in a collective the others left.
- A skipped step leaves the weights, the optimizer state (Adam moments and step count) and
  the LR schedule exactly as they were; its gradients are dropped. It reports
  `train/skipped_nonfinite` = 1 (0 on a normal step) and the driver logs a warning naming
  the step. The loop goes on with the next step (the samples of a skipped step are not
  retried: they are what produced the NaN).
- A checkpoint never holds non-finite weights: a rank's save checks its tensors first and
  raises `NonFiniteWeightsError` naming the tensor, before it writes anything (the
  checkpoint save then fails cleanly, `latest` unchanged: core/checkpoint.py).
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
import torch.distributed as dist

SKIPPED_METRIC = "train/skipped_nonfinite"


class NonFiniteWeightsError(RuntimeError):
    """Weights hold NaN/inf: they must not be checkpointed."""


def all_finite(values: Iterable[float]) -> bool:
    return all(math.isfinite(v) for v in values)


def tensors_finite(tensors: Iterable[torch.Tensor]) -> bool:
    """Whether every element of every (floating-point) tensor is finite."""
    return all(bool(torch.isfinite(t).all()) for t in tensors if t.is_floating_point() and t.numel())


def agree_to_skip(local_bad: bool, device: torch.device | str = "cpu", group: object = None) -> bool:
    """True on every rank when any rank saw a non-finite value (one MAX all-reduce; without
    a process group, the local verdict)."""
    if not (dist.is_available() and dist.is_initialized()):
        return local_bad
    flag = torch.tensor([1.0 if local_bad else 0.0], device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
    return bool(flag.item() > 0)


def first_nonfinite(named: Iterable[tuple[str, torch.Tensor]]) -> str | None:
    """The name of the first floating-point tensor holding a NaN/inf, else None."""
    for name, t in named:
        if t.is_floating_point() and t.numel() and not bool(torch.isfinite(t).all()):
            return name
    return None


def nonfinite_weights_message(name: str, where: str) -> str:
    return (f"refusing to checkpoint non-finite weights: {name} holds NaN/inf ({where}). Non-finite steps are "
            "skipped, so weights should never get here: resume from the previous checkpoint and report this "
            "with the run's metrics (train/skipped_nonfinite, train/grad_norm)")
