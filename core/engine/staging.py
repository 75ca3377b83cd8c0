"""The staging half of WeightReceiver: a session's staged tensors, the private shadows they
are received or copied into, and the host-memory loads of the tensor transport (SGLang's
flattened bucket, milepost's shm files). The session, the commit and the memory release stay
in weight_receiver.py, whose docstring holds the rules (atomicity, locks); milepost's CUDA
format is read by cuda_staging.py.

Received in place: a tensor that a memory resume left `unloaded` holds no value anyone may
read (the engine refuses to generate until every tensor is loaded: memory.py), so its
"shadow" is the live tensor itself and the commit copies nothing for it. This is every push
of colocated placement (release, the trainer's step, resume, push): one copy of the weights,
not two, and no second copy of them held on the GPU afterwards. A session that fails leaves
such tensors unloaded, so the engine still refuses to serve them.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, cast

import torch

from milepost.core.engine.shm_leases import Lease, LeaseError, ShmFiles
from milepost.core.quant.fp8 import FP8_DTYPE
from milepost.core.weight_sync import packing, wire

if TYPE_CHECKING:  # types only: the scheduler imports the parts of the engine
    from milepost.core.engine.scheduler import Scheduler


class UpdateRejected(Exception):
    """An update call that fails the session; `status` is the HTTP status to answer."""

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.status = status


@dataclass
class Session:
    selector: str
    touched_at: float = field(default_factory=time.monotonic)
    # canonical name → (tensor to swap in, lease on the shm file it lives in, or None)
    staged: dict[str, tuple[torch.Tensor, Lease | None]] = field(default_factory=dict)
    in_place: set[str] = field(default_factory=set)  # canonical names received in place (module docstring)
    # canonical names in the order they were received (staged or in place): a memory resume
    # lays the weights out in the last committed push's order (WeightReceiver.drop_weights)
    order: dict[str, None] = field(default_factory=dict)
    version: str | None = None
    failed: str | None = None


class Staging:
    """Staging methods of WeightReceiver, which owns the state below (and calls them under
    its update lock, as its docstring says)."""

    sched: Scheduler
    _lock: threading.Lock
    _session: Session | None
    _targets: dict[str, tuple[str, torch.Tensor]] | None  # name → (canonical, live)
    _shadows: dict[str, torch.Tensor]  # private staging tensors
    _files: ShmFiles
    unloaded: set[str]  # canonical names a memory resume allocated, not yet loaded

    def target_map(self) -> dict[str, tuple[str, torch.Tensor]]:
        """Every state-dict name → (canonical name, live tensor); tied names share one."""
        if self._targets is None:
            first: dict[int, str] = {}
            self._targets = {}
            for name, t in self.sched.model.state_dict(keep_vars=True).items():
                canonical = first.setdefault(id(t), name)
                self._targets[name] = (canonical, t)
        return self._targets

    def problems(self, specs: list[wire.Spec]) -> str | None:
        """Why `specs` do not fit the model (unknown name, other shape, a non-float into a
        float tensor), or None."""
        targets, problems = self.target_map(), []
        for s in specs:
            if s["name"] not in targets:
                problems.append(f"unknown tensor {s['name']}")
                continue
            live = targets[s["name"]][1]
            if list(s["shape"]) != list(live.shape):
                problems.append(f"{s['name']}: shape {list(s['shape'])} != {list(live.shape)}")
            elif wire.parse_dtype(s["dtype"]).is_floating_point != live.dtype.is_floating_point:
                problems.append(f"{s['name']}: dtype {s['dtype']} cannot load into {wire.dtype_name(live.dtype)}")
            elif (wire.parse_dtype(s["dtype"]) == FP8_DTYPE) != (live.dtype == FP8_DTYPE):
                problems.append(f"{s['name']}: dtype {s['dtype']} cannot load into {wire.dtype_name(live.dtype)} "
                                "(a cast would drop or ignore the block scales): fp8 weights go to an engine "
                                "started with --quantization fp8, from a trainer with precision.rollout fp8")
        return f"{len(problems)} tensors do not fit the model: {'; '.join(problems[:5])}" if problems else None

    def stage(self, name: str, tensor: torch.Tensor, lease: Lease | None) -> None:
        """Stage `tensor` for `name` in the open session (replacing an earlier one)."""
        self.stage_many([(name, tensor)], lease)

    def stage_many(self, staged: list[tuple[str, torch.Tensor]], lease: Lease | None = None) -> None:
        """stage(name, tensor, lease) for each pair, under one lock (a bucket's worth); a
        `lease` holds one reference per pair, taken by the caller."""
        targets = self.target_map()
        with self._lock:
            session = self._session
            if session is None:
                raise UpdateRejected("the session ended during the update")
            for name, tensor in staged:
                canonical = targets[name][0]
                previous = session.staged.get(canonical)
                if previous is not None and previous[1] is not None:
                    previous[1].release()
                session.staged[canonical] = (tensor, lease)
                session.order[canonical] = None

    def shadow_of(self, name: str) -> torch.Tensor | None:
        """The private shadow that `name` is staged into now, if any."""
        return self._shadows.get(self.target_map()[name][0])

    def shadow(self, name: str) -> torch.Tensor:
        """A private staging tensor for `name` (allocated on first use), staged."""
        canonical, live = self.target_map()[name]
        buf = self._shadows.get(canonical)
        if buf is None or buf.shape != live.shape or buf.dtype != live.dtype:
            self.forget_commit_plan()  # it may hold the shadow replaced here
            buf = self._shadows[canonical] = torch.empty_like(live)
        self.stage(name, buf, None)
        return buf

    def in_place_targets(self, specs: list[wire.Spec]) -> tuple[list[torch.Tensor], tuple[str, ...]] | None:
        """Where a bucket (which fits the model) is received in place (module docstring): the
        live tensors of `specs` and their canonical names (in specs order), if every one is
        unloaded, of the sent dtype and sent once. Else None. Nothing is staged: mark_in_place
        does that once the bytes are written."""
        targets = self.target_map()
        named = [targets[s["name"]] for s in specs]
        canonicals = tuple(c for c, _ in named)
        if (not specs or len(set(canonicals)) != len(named) or not self.unloaded.issuperset(canonicals)
                or any(wire.parse_dtype(s["dtype"]) != live.dtype for s, (_, live) in zip(specs, named))):
            return None
        return [live.data for _, live in named], canonicals

    def in_place_span(self, specs: list[wire.Spec]) -> tuple[torch.Tensor, tuple[str, ...]] | None:
        """in_place_targets where the live tensors also lie back to back in specs order
        (packing.py): them as one flat tensor, to receive a flattened bucket into. Else None."""
        found = self.in_place_targets(specs)
        flat = None if found is None else wire.span(found[0])
        return None if flat is None or found is None else (flat, found[1])

    def mark_in_place(self, canonicals: tuple[str, ...]) -> None:
        """Record in the open session that `canonicals` were received in place: the commit
        marks them loaded. A private tensor staged for one earlier is dropped (the live
        tensor now holds newer bytes); one staged later still goes in at the commit."""
        with self._lock:
            session = self._session
            if session is None:
                raise UpdateRejected("the session ended during the update")
            session.in_place.update(canonicals)
            session.order.update(dict.fromkeys(canonicals))
            for canonical in session.staged.keys() & set(canonicals):
                _, lease = session.staged.pop(canonical)
                if lease is not None:
                    lease.release()

    def forget_commit_plan(self) -> None:
        """Overridden by WeightReceiver: shadows are about to be replaced, so its kept commit
        plan (which holds them) must go first."""

    def shadow_span(self, specs: list[wire.Spec]) -> torch.Tensor | None:
        """The shadows of a flattened bucket (which fits the model) as one flat tensor,
        staged, to receive into with no copy. Shadows not yet back to back in `specs` order
        get one new buffer; since a committed shadow's live tensor becomes the next shadow,
        from the second push on live weights and shadows alternate between two such
        buffers. None (receive as sent, copy after) if a dtype differs from the model's or
        a tensor comes twice."""
        targets = self.target_map()
        named = [(s["name"], *targets[s["name"]]) for s in specs]
        if len({c for _, c, _ in named}) != len(named) or any(
                wire.parse_dtype(s["dtype"]) != live.dtype for s, (_, _, live) in zip(specs, named)):
            return None
        shadows = [self._shadows.get(c) for _, c, _ in named]
        flat = None
        if all(b is not None and b.shape == live.shape for b, (_, _, live) in zip(shadows, named)):
            flat = wire.span(cast("list[torch.Tensor]", shadows))  # none is None: checked above
        if flat is None:
            self.forget_commit_plan()  # it holds the old shadows
            for _, canonical, _ in named:  # free the old shadows first: no third copy of the weights
                self._shadows.pop(canonical, None)
            flat = torch.empty(sum(live.numel() for _, _, live in named), dtype=named[0][2].dtype,
                               device=named[0][2].device)
            pos = 0
            for _, canonical, live in named:
                self._shadows[canonical] = flat[pos:pos + live.numel()].view(live.shape)
                pos += live.numel()
        for name, canonical, _ in named:
            self.stage(name, self._shadows[canonical], None)
        return flat

    # ---- tensor transport, SGLang's format: a flattened bucket, copied into shadows ----
    def load_flat(self, flat: torch.Tensor, specs: list[wire.Spec]) -> str:
        """Stage `specs` (with byte `offset`s into `flat`) by copying them into private
        shadows: the sender may reuse its shared buffer once this call has answered."""
        problem = self.problems(specs)
        if problem:
            raise UpdateRejected(problem)
        self._copy_staged(flat, specs)
        return f"staged {len(specs)} tensors from a flattened bucket"

    def _copy_staged(self, flat: torch.Tensor, specs: list[wire.Spec]) -> None:
        """Copy `specs` (which fit the model) out of `flat` into staged shadows, or in place
        (module docstring); done on return."""
        in_place = self.in_place_targets(specs)
        packing.copy_bucket(in_place[0] if in_place else self.staging_targets(specs), flat, specs)
        if flat.is_cuda:  # the sender rewrites its buffer once this call answers: the copy must be done
            torch.cuda.current_stream(flat.device).synchronize()
        if in_place:
            self.mark_in_place(in_place[1])

    def staging_targets(self, specs: list[wire.Spec]) -> list[torch.Tensor]:
        """The staged shadows of `specs` (which fit the model), laid back to back where the
        dtypes allow (shadow_span), so packing.copy_bucket copies the bucket as one span."""
        if self.shadow_span(specs) is not None:
            return [self._shadows[self.target_map()[s["name"]][0]] for s in specs]
        return [self.shadow(s["name"]) for s in specs]

    # ---- tensor transport: the trainer's shm bucket files, used in place ----
    def load_shm(self, descriptor: dict[str, Any]) -> str:
        specs = descriptor["tensors"]
        problem = self.problems(specs)
        if problem:
            raise UpdateRejected(problem)
        devices = {str(self.target_map()[s["name"]][1].device) for s in specs} - {"cpu"}
        if devices:  # served in place means host memory: the engine does not announce it there
            raise UpdateRejected(f"milepost's shm format serves host memory in place and this engine's weights are on "
                                 f"{', '.join(sorted(devices))}: send SGLang's format (its /server_info "
                                 "tensor_formats does not list shm)")
        try:
            lease, buf = self._files.open(descriptor["shm_name"], descriptor["generation"])
        except LeaseError as exc:
            raise UpdateRejected(str(exc)) from None
        try:
            if buf.numel() < descriptor["nbytes"]:
                raise UpdateRejected(f"{descriptor['shm_name']} holds {buf.numel()} bytes, "
                                     f"descriptor says {descriptor['nbytes']}")
            targets = self.target_map()
            for s in specs:
                data, live = wire.view(buf, s["offset"], s), targets[s["name"]][1]
                if data.dtype == live.dtype:
                    lease.acquire()
                    self.stage(s["name"], data, lease)
                else:  # another dtype: a private converted copy
                    self.stage(s["name"], data.to(live.dtype), None)
        finally:
            lease.release()  # the reference taken by open(); staged tensors hold their own
        return f"staged {len(specs)} tensors from {descriptor['shm_name']}"

