"""The engine's side of milepost's CUDA format (cuda_buffers): a bucket that lies in a
trainer CUDA storage, copied into the receiver's staged shadows.

Why a cache: a trainer sends the same descriptor for a bucket on every push (its storages
are exported once and a bucket keeps its layout: WeightSender.to_cuda), and reading one
costs Python per tensor: base64 and JSON, the allow-list, the fit against the model, finding
the shadows and planning the copy. On the lent H100 that was decode_and_map 1.9 ms plus a
copy 1.1 ms slower than its bytes, for 4 buckets of a 3.4 GB push whose device copy takes
2.3 ms (bench/results/cuda_ipc_sync_3gb.txt). So each distinct payload string is read once:
its checked descriptor and its copy plan are kept and reused; the bytes are copied every time.

Rules, beside the code that keeps them:
- A plan is reused only while every shadow it copies into is still the receiver's shadow for
  that tensor (`_valid`): a memory release or a re-laid shadow span makes a new plan. A plan
  that receives in place (staging.py) is reused only while its tensors are unloaded and have
  not moved (the receiver's `epoch`): the commit that loads them ends it.
- The allow-list and the fit against the model ran when the descriptor was first read, on the
  same payload string and the same model (its tensors' names, shapes and device do not change).
- `clear()` on a memory release: plans hold shadows (GPU memory); the mappings the last push
  did not read go (those it read stay mapped: MappedStorages.sweep says why). The checked
  descriptors (data, no memory) are kept: colocated placement releases before every push, and
  its push into the weights a resume left unloaded (staging.py: received in place) plans
  again from them without decoding.
- A new plan drops every plan whose shadows are no longer the receiver's: they would keep the
  replaced shadows' memory alive. At most MAX_PLANS payloads are kept, the oldest dropped.
"""

from __future__ import annotations

import base64
import json
import pickle
from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from milepost.core.engine.staging import UpdateRejected
from milepost.core.weight_sync import cuda_buffers, packing, wire

if TYPE_CHECKING:  # types only: the receiver owns this
    from milepost.core.engine.weight_receiver import WeightReceiver

MAX_PLANS = 64


@dataclass
class _Plan:
    descriptor: dict[str, Any]  # checked by cuda_buffers.decode_descriptor and against the model; read-only
    staged: list[tuple[str, torch.Tensor]]  # (name, the shadow it is copied into), in specs order
    copy: packing.BucketCopy
    in_place: tuple[str, ...] = ()  # received in place (staging.py): these canonical names, no shadows
    epoch: int = 0  # the receiver's epoch when planned: an in-place plan holds live tensors' memory


class CudaStaging:
    """Reads milepost's CUDA payloads for one WeightReceiver (whose update lock serialises
    the callers: not thread-safe by itself)."""

    def __init__(self, receiver: WeightReceiver, device_type: str = "cuda") -> None:
        """`device_type`: where the engine's weights must be (tests/unit/test_cuda_staging.py
        runs this class on CPU weights, with the trainer's storages mapped by hand)."""
        self.receiver, self.device_type = receiver, device_type
        self.mapped = cuda_buffers.MappedStorages()
        self._plans: OrderedDict[str, _Plan] = OrderedDict()
        # payload → its checked descriptor and the bucket's layout in the trainer's storage
        self._descriptors: OrderedDict[str, tuple[dict[str, Any], packing.BucketLayout]] = OrderedDict()

    def knows(self, payload: str) -> bool:
        """Was `payload` (one `serialized_named_tensors` entry) read before? Then `load` takes
        it without decoding it again."""
        return payload in self._plans or payload in self._descriptors

    def has_plan(self, payload: str) -> bool:
        """Is a copy plan (which holds shadows) kept for `payload`?"""
        return payload in self._plans

    def load(self, payload: str, body: Any = None) -> str:
        """Stage the bucket `payload` describes by copying it out of the trainer's mapped
        storage into private shadows; done (synchronised) on return. `body`: the payload's
        JSON, where the caller parsed it already."""
        plan = self._plans.get(payload)
        reused = plan is not None and self._valid(plan)
        if plan is not None and reused:
            self._plans.move_to_end(payload)
            if plan.staged:
                self.receiver.stage_many(plan.staged)
        else:
            plan = self._plan(*self._descriptor(payload, body))
            # planning may have re-laid shadows that older plans hold: those would keep the old
            # shadows' GPU memory alive until dropped
            self._plans = OrderedDict((k, p) for k, p in self._plans.items() if k != payload and self._valid(p))
            self._plans[payload] = plan
            while len(self._plans) > MAX_PLANS:
                self._plans.popitem(last=False)
        try:
            storage = self.mapped.storage(plan.descriptor)
        except (pickle.UnpicklingError, RuntimeError) as exc:  # not visible here, or a stale handle
            raise UpdateRejected(f"cannot map the trainer's CUDA storage: {exc}") from None
        plan.copy.run(storage)
        if storage.is_cuda:  # the trainer may rewrite it once we answer: the copy must be done
            torch.cuda.current_stream(storage.device).synchronize()
        if plan.in_place:
            self.receiver.mark_in_place(plan.in_place)
        where = f"{len(plan.in_place)} tensors in place" if plan.in_place else f"{len(plan.staged)} tensors"
        return (f"staged {where} from a mapped trainer storage "
                f"({len(self.mapped)} mapped; copied {plan.copy.describe()}; "
                f"{'plan reused' if reused else 'planned'})")

    def _descriptor(self, payload: str, body: Any) -> tuple[dict[str, Any], packing.BucketLayout]:
        """`payload`'s descriptor, checked by cuda_buffers.decode_descriptor and against the
        model once per payload (the model's names, shapes, dtypes and device do not change),
        and its bucket's layout."""
        known = self._descriptors.get(payload)
        if known is None:
            if body is None:
                body = json.loads(base64.b64decode(payload, validate=True))
            descriptor = cuda_buffers.decode_descriptor(body)
            self._check(descriptor["tensors"])
            known = self._descriptors[payload] = (descriptor, packing.BucketLayout(descriptor["tensors"]))
            while len(self._descriptors) > MAX_PLANS:
                self._descriptors.popitem(last=False)
        else:
            self._descriptors.move_to_end(payload)
        return known

    def _check(self, specs: list[wire.Spec]) -> None:
        """Refuse `specs` that do not fit the model, or an engine whose weights are not on a GPU."""
        receiver = self.receiver
        problem = receiver.problems(specs)
        if problem:
            raise UpdateRejected(problem)
        targets = receiver.target_map()
        devices = {targets[s["name"]][1].device.type for s in specs}
        if devices != {self.device_type} and specs:
            raise UpdateRejected(f"milepost's CUDA format is for engines on a GPU and this engine's weights are on "
                                 f"{', '.join(sorted(devices))}: send the shm format (its /server_info "
                                 "tensor_formats lists what it reads)")

    def _plan(self, descriptor: dict[str, Any], layout: packing.BucketLayout) -> _Plan:
        """Plan the copy of a checked descriptor's bucket: in place where the receiver allows
        it (staging.py), else into staged shadows."""
        receiver, specs = self.receiver, descriptor["tensors"]
        in_place = receiver.in_place_targets(specs)
        if in_place is not None:  # a copy per run that lies back to back on both sides
            return _Plan(descriptor, [], packing.BucketCopy(in_place[0], layout), in_place[1], receiver.epoch)
        shadows = receiver.staging_targets(specs)
        return _Plan(descriptor, [(s["name"], t) for s, t in zip(specs, shadows)], packing.BucketCopy(shadows, layout))

    def _valid(self, plan: _Plan) -> bool:
        """An in-place plan: while its tensors stay where they were and unloaded; else while
        every shadow it copies into is still the receiver's."""
        if plan.in_place:
            return plan.epoch == self.receiver.epoch and self.receiver.unloaded.issuperset(plan.in_place)
        return all(self.receiver.shadow_of(name) is t for name, t in plan.staged)

    def clear(self) -> int:
        """Forget every plan and unmap every storage the last push did not read (a memory
        release: MappedStorages.sweep); returns how many were unmapped."""
        self._plans.clear()
        return self.mapped.sweep()
