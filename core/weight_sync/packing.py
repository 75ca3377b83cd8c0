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


class Copies:
    """Copies planned as spans (each one copy of a run that lies back to back on both sides)
    and the rest (one multi-tensor copy, wire.copy_all); `run` costs Python per span."""

    def __init__(self, spans: list[tuple[torch.Tensor, torch.Tensor]],
                 rest: tuple[list[torch.Tensor], list[torch.Tensor]]) -> None:
        self.spans, self.rest = spans, rest

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


class CopyRuns(Copies):
    """targets[i] <- sources[i] for every i, planned as few copies as the two layouts allow:
    each run of pairs that lie back to back on both sides (one dtype) is one copy of its
    span; the rest go in one multi-tensor copy. Planning costs Python per pair."""

    def __init__(self, targets: list[torch.Tensor], sources: list[torch.Tensor]) -> None:
        super().__init__([], ([], []))
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


class BucketLayout:
    """Where each tensor of a bucket lies in its flat uint8 buffer, read from its specs once:
    (byte offset, bytes, dtype) a tensor. A copy out of the buffer is then planned by integer
    arithmetic (BucketCopy); a view a tensor cost ~3 us of Python, 2.8 ms for 841 tensors on
    a CPU core, at every push into the weights a memory resume laid out anew."""

    def __init__(self, specs: list[wire.Spec]) -> None:
        self.specs = specs
        self.places = [(int(s["offset"]), wire.spec_nbytes(s), wire.parse_dtype(s["dtype"])) for s in specs]


class BucketCopy:
    """A planned copy of a bucket out of a flat uint8 buffer into `targets`: each run of
    tensors that lies back to back both in the buffer and in the targets (the engine's shadows
    after shadow_span; the weights a memory resume lays out in the last push's order,
    WeightReceiver._resume_order) is one copy of its span, the rest one multi-tensor copy.
    The runs are found from addresses (no view a tensor) at the first copy out of a buffer and
    kept while the same buffer comes again (a mapped trainer storage: core/engine/cuda_staging.py
    keeps this plan per payload)."""

    def __init__(self, targets: list[torch.Tensor], layout: BucketLayout) -> None:
        self.targets, self.layout = targets, layout
        self._copies: tuple[tuple[int, int], Copies] | None = None  # (the buffer's address and size, its copies)

    def run(self, flat: torch.Tensor) -> None:
        key = (flat.data_ptr(), flat.numel())
        if self._copies is None or self._copies[0] != key:
            self._copies = (key, self._plan(flat))
        self._copies[1].run()

    def _plan(self, flat: torch.Tensor) -> Copies:
        targets, places, n = self.targets, self.layout.places, len(self.targets)
        copies, i = Copies([], ([], [])), 0
        while i < n:
            offset, nbytes, dtype = places[i]
            head, j = targets[i], i + 1
            start = head.data_ptr()
            end, stop = start + nbytes, offset + nbytes
            spannable = _holds(head, nbytes, dtype)
            while spannable and j < n:
                at, size, kind = places[j]
                if at != stop or kind != dtype or targets[j].data_ptr() != end or not _holds(targets[j], size, kind):
                    break
                end, stop, j = end + size, stop + size, j + 1
            storage = head.untyped_storage()
            if spannable and (j - i > 1 or n == 1) and end <= storage.data_ptr() + storage.nbytes():
                into = torch.as_strided(head, ((end - start) // dtype.itemsize,), (1,))
                copies.spans.append((into, flat[offset:stop].view(dtype)))
            else:
                copies.rest[0].extend(targets[i:j])
                copies.rest[1].extend(wire.view(flat, places[k][0], self.layout.specs[k]) for k in range(i, j))
            i = j
        return copies

    def describe(self) -> str:
        """How the last run copied (after `run`)."""
        return "not run yet" if self._copies is None else self._copies[1].describe()


def _holds(target: torch.Tensor, nbytes: int, dtype: torch.dtype) -> bool:
    """Can `target` be written as part of a span of `dtype` bytes, `nbytes` of them its own?"""
    return target.dtype == dtype and target.nbytes == nbytes and target.is_contiguous()


def copy_bucket(targets: list[torch.Tensor], flat: torch.Tensor, specs: list[wire.Spec]) -> None:
    """targets[i] <- the tensor `specs[i]` at its byte `offset` of the uint8 buffer `flat`
    (BucketCopy, planned for this one copy)."""
    BucketCopy(targets, BucketLayout(specs)).run(flat)
