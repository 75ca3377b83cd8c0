"""The trainer's side of milepost's CUDA format (cuda_buffers): a bucket's tensors named in
CUDA storages that an engine maps once, for WeightSender.to_cuda.

A bucket is read in place where its tensors lie in one storage (packed parameters, or
Megatron's staged views of its parameters: no copy), else copied into the bucket's reused CUDA
buffer. Each storage is exported once per reader and kept (an engine maps each export once).

Why plans are kept: tensors sent as they are (no fp8) keep their bucket's plan (where each
lies, the encoded descriptors) while they keep their addresses, shapes and dtypes, so the
same descriptors go out every push and an engine reads a descriptor it saw before without
decoding it again (core/engine/cuda_staging.py). Planning costs Python per tensor: on the
lent H100, 8.6 ms of a packed 3.4 GB push (4 buckets, 841 tensors) was the trainer's Python,
against 2.3 ms for a device copy of all its bytes (bench/results/cuda_ipc_sync_3gb.txt).

Rules, beside the code that keeps them:
- A plan is used only while it `fits`: the same tensors' addresses, shapes and dtypes, and
  (copied) the bucket buffer kept now. One plan per bucket index (a new plan replaces it),
  so a dropped plan never keeps a weight span or a buffer alive.
- The stream is synchronised before descriptors are returned: the bytes are complete when
  an engine reads them (cuda_buffers' ordering rules).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from milepost.core.weight_sync import cuda_buffers, wire

Signature = list[tuple[int, torch.Size, torch.dtype]]
Gather = Callable[[list[str]], list[tuple[wire.Spec, torch.Tensor]]]


def packed_placement(pairs: list[tuple[wire.Spec, torch.Tensor]]) -> tuple[torch.Tensor, list[wire.Spec]] | None:
    """Where a bucket lies in place: (a tensor of the one storage its tensors share, each spec
    with its byte offset in that storage), or None where they are not all contiguous views of
    one storage. Back to back (packed parameters, wire.span) or not: Megatron's parameters lie
    in one buffer in megatron's order, not in the bucket's HF order, and the engine reads each
    tensor at its own offset (one copy of the span where they are back to back)."""
    if not pairs:
        return None
    first = pairs[0][1]
    base = first.untyped_storage().data_ptr()
    if not all(t.is_contiguous() and t.untyped_storage().data_ptr() == base for _, t in pairs):
        return None
    return first, [{**spec, "offset": t.storage_offset() * t.element_size()} for spec, t in pairs]


def signature(tensors: list[torch.Tensor]) -> Signature:
    """What a bucket plan depends on: each tensor's address, shape and dtype."""
    return [(t.data_ptr(), t.shape, t.dtype) for t in tensors]


@dataclass
class CudaBucketPlan:
    """How one bucket goes out."""
    names: tuple[str, ...]
    in_place: bool  # read where the weights lie (packed), else copied into `flat` each push
    flat: torch.Tensor  # whose storage is exported: one of the weights (in place) or the bucket buffer
    placed: list[wire.Spec]  # each tensor with its byte offset in flat's storage
    made_for: Signature  # signature() of the tensors planned
    descriptors: dict[int, list[str]] = field(default_factory=dict)  # readers → encoded descriptors
    # copied: the concatenation's views (wire.concatenation), made at the first fill; they
    # hold the planned tensors, which the plan's signature names anyway
    concatenation: tuple[list[torch.Tensor], torch.Tensor] | None = None

    def fits(self, names: list[str], tensors: list[torch.Tensor], buffer: torch.Tensor | None) -> bool:
        """Still right for `names` as `tensors`, with bucket buffer `buffer` (the one kept now)?"""
        return (tuple(names) == self.names and (self.in_place or buffer is self.flat)
                and signature(tensors) == self.made_for)


class CudaSender:
    """Bucket buffers, exports and plans of one WeightSender (one caller at a time)."""

    def __init__(self) -> None:
        self.buffers: dict[int, torch.Tensor] = {}  # bucket → CUDA buffer (copied buckets)
        self._exports: dict[tuple[int, int, int], dict[str, Any]] = {}  # (storage, bytes, reader) → export
        self._plans: dict[int, CudaBucketPlan] = {}  # bucket → its plan

    def send(self, names: list[str], bucket: int, readers: int, tensors: list[torch.Tensor] | None,
             gather: Gather) -> list[str]:
        """Descriptors of bucket `bucket` (`names`), one per reader. `tensors`: the live
        tensors as they are sent, whose plan may be kept; None for tensors computed at send
        time (fp8), planned every push. `gather(names)`: the (spec, tensor) pairs to plan from."""
        if tensors is not None:
            plan = self._plans.get(bucket)
            if plan is None or not plan.fits(names, tensors, self.buffers.get(bucket)):
                plan = self._plans[bucket] = self._plan(names, bucket, gather(names))
        else:
            pairs = gather(names)
            tensors, plan = [t for _, t in pairs], self._plan(names, bucket, pairs)
        if not plan.in_place:
            self._fill(plan, tensors)
        torch.cuda.current_stream(plan.flat.device).synchronize()  # the engine reads on its own stream
        if readers not in plan.descriptors:
            storage = plan.flat.untyped_storage()
            plan.descriptors[readers] = [cuda_buffers.encode_descriptor(self._export(storage, plan.flat, r),
                                                                        plan.placed) for r in range(readers)]
        return plan.descriptors[readers]

    @staticmethod
    def _fill(plan: CudaBucketPlan, tensors: list[torch.Tensor]) -> None:
        """The bucket's tensors into its buffer: one concatenation where all are on the buffer's
        device (its views kept in the plan: wire.concatenation), else one multi-tensor copy
        (host tensors, another GPU)."""
        with torch.no_grad():  # kept vars may require grad, and cat(out=) records no graph
            if plan.concatenation is None and all(t.device == plan.flat.device for t in tensors):
                plan.concatenation = wire.concatenation(plan.flat, [t.detach() for t in tensors])
            if plan.concatenation is not None:
                torch.cat(plan.concatenation[0], out=plan.concatenation[1])
            else:
                wire.copy_all([wire.view(plan.flat, s["offset"], s) for s in plan.placed], tensors)

    def _plan(self, names: list[str], bucket: int, pairs: list[tuple[wire.Spec, torch.Tensor]]) -> CudaBucketPlan:
        """Where a bucket's tensors are read from: in place (packed_placement), else bucket
        `bucket`'s CUDA buffer (made or grown here), with every tensor's byte offset."""
        tensors = [t for _, t in pairs]
        in_place = packed_placement(pairs) if tensors and tensors[0].is_cuda else None
        if in_place is not None:
            return CudaBucketPlan(tuple(names), True, *in_place, signature(tensors))
        specs = [s for s, _ in pairs]
        offs, total = wire.offsets(specs)
        device = tensors[0].device if tensors and tensors[0].is_cuda else torch.device("cuda")
        kept = self.buffers.get(bucket)
        if kept is None or kept.numel() < total or kept.device != device:
            self._forget_exports(kept)
            kept = self.buffers[bucket] = torch.empty(max(total, 1), dtype=torch.uint8, device=device)
        placed = [{**spec, "offset": o} for spec, o in zip(specs, offs)]
        return CudaBucketPlan(tuple(names), False, kept, placed, signature(tensors))

    def _export(self, storage: torch.UntypedStorage, tensor: torch.Tensor, reader: int) -> dict[str, Any]:
        key = (storage.data_ptr(), storage.nbytes(), reader)
        if key not in self._exports:
            self._exports[key] = cuda_buffers.export_storage(tensor)
        return self._exports[key]

    def _forget_exports(self, buffer: torch.Tensor | None) -> None:
        if buffer is not None:
            ptr = buffer.untyped_storage().data_ptr()
            self._exports = {k: v for k, v in self._exports.items() if k[0] != ptr}

    def release(self) -> None:
        """Drop every buffer, export and plan (the trainer's memory goes back to it)."""
        self.buffers.clear()
        self._exports.clear()
        self._plans.clear()
