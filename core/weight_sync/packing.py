"""Weights laid out back to back, and copies between such layouts in few large pieces.

Why: on a GPU, one multi-tensor copy of a 201-tensor 1 GB bucket took ~5 ms on the H200 and
one copy of its span ~0.6 ms (bench/results/cuda_ipc_sync_phases.txt): the per-tensor launch,
not the bytes, is the cost. Both ends of a weight push lay their weights out back to back
(the trainer before its optimizer, `pack_parameters`; the built-in engine on a GPU at load
and at a memory resume), so a bucket, a staged copy and a commit are each a few spans.
"""

from __future__ import annotations

import torch

from milepost.core.weight_sync import wire


def pack_parameters(module: torch.nn.Module, device: torch.device | None = None) -> int:
    """Lay `module`'s parameters out back to back, one buffer per dtype and device, in state-dict order
    (a tied parameter once, where it first appears), and point each at its place. Values,
    Parameter objects and ties are unchanged. Why: a weight bucket is then one span of
    memory, which the transports send in a few large pieces with no copy (wire.span). Call
    before building the optimizer or DDP (they hold the old storages otherwise). `device`:
    the buffers' device, the parameters moved there as they are packed (from host memory, the
    device holds one copy of the weights at any time, not two). Returns the bytes moved."""
    params: dict[int, torch.nn.Parameter] = {}
    for t in module.state_dict(keep_vars=True).values():
        if isinstance(t, torch.nn.Parameter) and t.is_contiguous():
            params.setdefault(id(t), t)
    return pack_in_order(list(params.values()), device)


def pack_in_order(params: list[torch.nn.Parameter], device: torch.device | None = None) -> int:
    """pack_parameters for `params` in this order (each once): values kept, each pointed at its
    place in one buffer per dtype and device. Returns the bytes moved."""
    old = [p.data for p in params]
    allocate_packed([(p, p.shape, p.dtype) for p in params], device)
    for p, data in zip(params, old):
        p.data.copy_(data)
    return sum(p.numel() * p.element_size() for p in params)


def allocate_packed(tensors: list[tuple[torch.Tensor, torch.Size, torch.dtype]],
                    device: torch.device | None = None) -> None:
    """Point each tensor (in this order) at uninitialised memory of its shape and dtype, laid
    out back to back in one buffer per dtype and device (each tensor's own, or `device`): a
    memory resume gets pack_parameters' layout again, without the copy."""
    groups: dict[tuple[torch.dtype, torch.device], list[tuple[torch.Tensor, torch.Size]]] = {}
    for t, shape, dtype in tensors:
        groups.setdefault((dtype, device or t.device), []).append((t, shape))
    for (dtype, on), same in groups.items():
        buf, pos = torch.empty(sum(shape.numel() for _, shape in same), dtype=dtype, device=on), 0
        for t, shape in same:
            t.data = buf[pos:pos + shape.numel()].view(shape)
            pos += shape.numel()


class CopyRuns:
    """targets[i] <- sources[i] for every i, planned as few copies as the two layouts allow:
    each run of pairs that lie back to back on both sides (one dtype) is one copy of its
    span; the rest go in one multi-tensor copy (wire.copy_all). Planning costs Python per
    pair; `run` costs Python per run."""

    def __init__(self, targets: list[torch.Tensor], sources: list[torch.Tensor]) -> None:
        self.spans: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.rest: tuple[list[torch.Tensor], list[torch.Tensor]] = ([], [])
        i, n = 0, len(targets)
        while i < n:
            j = i + 1
            while (j < n and targets[i].dtype == sources[i].dtype and wire.adjacent(targets[j - 1], targets[j])
                   and wire.adjacent(sources[j - 1], sources[j])):
                j += 1
            into, out_of = wire.span(targets[i:j]), wire.span(sources[i:j])
            if (j - i > 1 or n == 1) and into is not None and out_of is not None:
                self.spans.append((into, out_of))
            else:
                self.rest[0].extend(targets[i:j])
                self.rest[1].extend(sources[i:j])
            i = j

    @property
    def num_copies(self) -> int:
        return len(self.spans) + (1 if self.rest[0] else 0)

    def run(self) -> None:
        for into, out_of in self.spans:
            into.copy_(out_of)
        if self.rest[0]:
            wire.copy_all(*self.rest)

    def describe(self) -> str:
        if not self.rest[0] and len(self.spans) == 1:
            return "as one span"
        if not self.spans:
            return "tensor by tensor"
        return f"in {len(self.spans)} spans and {len(self.rest[0])} tensors"


class BucketCopy:
    """A planned copy of a bucket out of a flat uint8 buffer into `targets`: CopyRuns from the
    specs' views of the buffer, so each run that lies back to back on both sides (the engine's
    shadows after shadow_span; the weights a memory resume lays out in the last push's order,
    WeightReceiver._resume_order) is one copy of its span. The runs are planned at the first
    copy out of a buffer and kept while the same buffer comes again (a mapped trainer storage:
    core/engine/cuda_staging.py keeps this plan per payload)."""

    def __init__(self, targets: list[torch.Tensor], specs: list[wire.Spec]) -> None:
        self.targets, self.specs = targets, specs
        self._runs: tuple[tuple[int, int], CopyRuns] | None = None  # (the buffer's address and size, its runs)

    def run(self, flat: torch.Tensor) -> None:
        key = (flat.data_ptr(), flat.numel())
        if self._runs is None or self._runs[0] != key:
            self._runs = (key, CopyRuns(self.targets, [wire.view(flat, int(x["offset"]), x) for x in self.specs]))
        self._runs[1].run()

    def describe(self) -> str:
        """How the last run copied (after `run`)."""
        return "not run yet" if self._runs is None else self._runs[1].describe()


def copy_bucket(targets: list[torch.Tensor], flat: torch.Tensor, specs: list[wire.Spec]) -> None:
    """targets[i] <- the tensor `specs[i]` at its byte `offset` of the uint8 buffer `flat`
    (BucketCopy, planned for this one copy)."""
    BucketCopy(targets, specs).run(flat)
