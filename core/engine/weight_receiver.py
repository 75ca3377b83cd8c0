"""The engine's half of session weight updates: /begin_weight_update, then buckets through
/update_weights_from_tensor (named /dev/shm buffers) or /update_weights_from_distributed
(a gloo group with the trainer), then /update_weight_version and /end_weight_update.

Payload formats live in milepost.core.weight_sync.wire; HTTP parsing in weight_routes.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import torch

from milepost.core.engine.cuda_staging import CudaStaging
from milepost.core.engine.group_receiver import GroupReceiver
from milepost.core.engine.shm_leases import Lease, ShmFiles
from milepost.core.engine.staging import Session, Staging, UpdateRejected
from milepost.core.weight_sync.packing import CopyRuns, allocate_packed

if TYPE_CHECKING:  # types only: the scheduler imports the parts of the engine
    from milepost.core.engine.scheduler import Scheduler

log = logging.getLogger("milepost.engine")

Reply = tuple[int, str]  # (HTTP status, message); 200 means success
__all__ = ["Reply", "UpdateRejected", "WeightReceiver"]  # UpdateRejected: staging.py


class WeightReceiver(Staging):
    """Stages weights of one session and swaps them in at its end.

    Atomicity: update calls never write the live model. A distributed bucket is received
    into private *shadow* tensors (a flattened one into shadows laid out back to back); a
    tensor-transport bucket is staged as views into the trainer's shm file (no copy; a
    lease keeps the trainer from rewriting the file).
    end_weight_update commits by pointing each live parameter at its staged tensor (under
    the scheduler's model_lock) and setting the staged weight_version in the same critical
    section: a forward sees all-old or all-new weights, and /model_info never names weights
    the engine does not serve. A session commits only if a new weight_version was staged
    (SGLang's sequence sets it just before end), none of its update calls failed and end
    was not asked to abort; otherwise end discards it. A private tensor swapped out
    becomes the next shadow; a leased one releases its lease. Live tensors in shm files are
    never written in place (a disk load swaps in fresh tensors too). The one exception: a
    tensor a memory resume left unloaded, which nothing may read, is received in place
    (staging.py), and its commit only marks it loaded.

    Concurrency: `_lock` guards the session fields and is held only briefly. `_update_lock`
    serialises update calls, commit, discard and disk adoption (one writer of shadows and
    leases; collectives in call order) and is always taken with a timeout. Order:
    _update_lock, then model_lock. A session idle for `session_timeout_s` is stale (its
    trainer is gone): the next begin discards it. Distributed receives wait at most the
    group's timeout.
    """

    def __init__(self, sched: Scheduler, timeout_s: float = 300.0) -> None:
        """`timeout_s`: idle time after which a session is stale, and the weight-update
        group's timeout (rendezvous and every broadcast)."""
        self.sched, self.session_timeout_s, self.group_timeout_s = sched, timeout_s, timeout_s
        self.lock_timeout_s = min(60.0, timeout_s)
        self._lock = threading.Lock()
        self._update_lock = threading.Lock()
        self._session: Session | None = None
        self._targets: dict[str, tuple[str, torch.Tensor]] | None = None  # name → (canonical, live)
        self._shadows: dict[str, torch.Tensor] = {}  # private staging tensors (staging.py)
        self._commit_plan: tuple[tuple[object, ...], list[torch.Tensor], CopyRuns] | None = None  # _commit_runs
        self._live_leases: dict[str, Lease] = {}  # canonical name → lease of the file it lives in
        self._files = ShmFiles()
        self.cuda = CudaStaging(self)  # milepost's CUDA format: trainer storages mapped once, reads planned once
        self.groups = GroupReceiver(self)  # the distributed transport's side
        self.unloaded: set[str] = set()  # canonical names allocated by a memory resume, not yet loaded
        self._push_order: list[str] = []  # canonical names as the last whole committed push sent them (_resume_order)
        self.epoch = 0  # bumped whenever a live tensor's storage is replaced (fast_path.ContinuousDriver)
        self.generation = 0  # bumped (under model_lock) whenever live weights may change: swap, copy, release, allocate

    # ---- session ----
    def in_session(self) -> bool:
        with self._lock:
            return self._session is not None

    def begin(self, selector: str) -> Reply:
        problem = self.sched.memory.update_problem()
        if problem:
            return 400, problem
        if not self._update_lock.acquire(timeout=self.lock_timeout_s):
            return 409, "an update call is still running; call /begin_weight_update again"
        try:
            with self._lock:
                s = self._session
                if s is not None and time.monotonic() - s.touched_at < self.session_timeout_s:
                    return 400, ("a weight-update session is already open: finish it with "
                                 "/end_weight_update before beginning another")
                self._session = Session(selector)
            self.cuda.mapped.new_push()
            if s is not None:
                log.warning("discarding a weight-update session idle for %.0f s", time.monotonic() - s.touched_at)
                self._discard(s)
            self._files.prune()
        finally:
            self._update_lock.release()
        return 200, f"weight-update session open (selector={selector})"

    def stage_version(self, version: str) -> bool:
        """Inside a session the new version waits for end_weight_update; False if no session."""
        with self._lock:
            if self._session is None:
                return False
            self._session.version, self._session.touched_at = version, time.monotonic()
            return True

    def end(self, abort: bool = False) -> Reply:
        """Commit the session, or discard it if `abort`, if an update failed, or if no new
        weight_version was staged."""
        if not self._update_lock.acquire(timeout=self.lock_timeout_s):
            return 409, "an update call is still running in this session; call /end_weight_update again"
        try:
            with self._lock:
                s, self._session = self._session, None
            if s is None:
                return 400, "no weight-update session is open: call /begin_weight_update first"
            served = f"the engine still serves weight_version {self.sched.weight_version}"
            if abort or s.failed or s.version is None:
                self._discard(s)
            if abort:
                return 200, f"session aborted: staged tensors discarded; {served}"
            if s.failed:
                return 400, f"session discarded because an update failed ({s.failed}); {served}"
            if s.version is None:
                return 200, f"session closed with no new weight_version: staged tensors discarded; {served}"
            return self._commit(s, s.version)
        finally:
            self._update_lock.release()

    def _commit(self, s: Session, version: str) -> Reply:
        if not self.sched.model_lock.acquire(timeout=self.lock_timeout_s):
            self._discard(s)
            return 503, f"model busy for {self.lock_timeout_s} s; still serving {self.sched.weight_version}"
        try:
            targets = self.target_map()
            copied = {c: t for c, (t, lease) in s.staged.items() if self._copies_in(targets[c][1], t, lease)}
            self._commit_runs(copied).run()
            self._copied_in(copied)
            self._loaded_in_place(s.in_place - copied.keys())  # received in place (staging.py): nothing to copy
            for canonical, (tensor, lease) in s.staged.items():
                if canonical not in copied:
                    self._swap_in(canonical, tensor, lease)
            self.sched.weight_version = version
            if len(s.order) == len(self._canonicals()):  # a whole push: a subset's order says little
                self._push_order = list(s.order)
                # the trainer storages it did not read are stale: a restarted trainer's first push (its
                # stage serves its checkpoint before any rollout) lets go of the dead one's memory here,
                # not at the first memory release after the first rollout
                self.cuda.mapped.sweep()
        finally:
            self.sched.model_lock.release()
        return 200, f"committed {len(s.staged.keys() | s.in_place)} tensors as weight_version {s.version}"

    def _commit_runs(self, copied: dict[str, torch.Tensor]) -> CopyRuns:
        """The copies of `copied` (canonical name → staged tensor) into the live tensors, as
        few as the layouts allow: on a GPU the live weights lie back to back (packing.py) and
        so do a bucket's shadows, so a commit is a few span copies, not one per tensor.
        Planning them costs Python per tensor (3 ms for 841 tensors on a CPU core), so the
        plan is kept while the same shadows go into the same live tensors: it holds the
        shadows (their ids are its key) and is dropped before any shadow is replaced
        (forget_commit_plan) or a live tensor moves (`epoch`)."""
        sources = list(copied.values())
        key = (self.epoch, tuple(copied), tuple(map(id, sources)))
        if self._commit_plan is None or self._commit_plan[0] != key:
            targets = self.target_map()
            self._commit_plan = (key, sources, CopyRuns([targets[c][1].data for c in copied], sources))
        return self._commit_plan[2]

    def forget_commit_plan(self) -> None:
        self._commit_plan = None

    def _loaded_in_place(self, names: set[str]) -> None:
        """Bookkeeping after `names` were received in place (caller holds both locks): they
        are loaded (and the next push into them stages privately again)."""
        if names:
            self.generation += 1  # contents changed (quantized.py re-quantises on it)
            self.unloaded.difference_update(names)

    @staticmethod
    def _copies_in(live: torch.Tensor, tensor: torch.Tensor, lease: Lease | None) -> bool:
        """Is `tensor` copied into the live tensor rather than swapped in? On a GPU, yes: CUDA
        graphs captured over the live tensor stay valid (static_model.py)."""
        return live.is_cuda and lease is None and bool(live.numel()) and live.shape == tensor.shape

    def _copied_in(self, copied: dict[str, torch.Tensor]) -> None:
        """Bookkeeping after `copied` (canonical name → staged tensor) was copied into the live
        tensors (caller holds both locks): each staged tensor stays that name's next shadow."""
        if not copied:
            return
        self.generation += 1  # contents changed (quantized.py re-quantises on it)
        self.unloaded.difference_update(copied)
        targets = self.target_map()
        for canonical, tensor in copied.items():
            live = targets[canonical][1]
            if tensor.device == live.device and tensor.dtype == live.dtype:
                if self._shadows.get(canonical) is not tensor:
                    self.forget_commit_plan()  # it holds the shadow replaced here
                self._shadows[canonical] = tensor

    def _swap_in(self, canonical: str, tensor: torch.Tensor, lease: Lease | None) -> None:
        """Point the live tensor at `tensor`, or copy it in where the live tensor must keep its
        address (_copies_in) (caller holds model_lock and _update_lock)."""
        live = self.target_map()[canonical][1]
        if self._copies_in(live, tensor, lease):
            live.data.copy_(tensor)
            self._copied_in({canonical: tensor})
            return
        self.generation += 1  # contents change (quantized.py re-quantises on it)
        self.epoch += 1  # the live tensor moves: whoever holds its address must look again
        self.forget_commit_plan()  # it holds the shadows replaced here
        old, old_lease = live.data, self._live_leases.pop(canonical, None)
        live.data = tensor
        self.unloaded.discard(canonical)
        if lease is not None:
            self._live_leases[canonical] = lease
        if self._shadows.get(canonical) is tensor:  # a private shadow went live
            del self._shadows[canonical]
        if old_lease is not None:
            old_lease.release()
        else:
            self._shadows[canonical] = old  # private: the next shadow

    def _discard(self, s: Session) -> None:
        """Drop what a session staged (caller holds _update_lock)."""
        for _, lease in s.staged.values():
            if lease is not None:
                lease.release()
        s.staged.clear()

    def adopt(self, state: dict[str, torch.Tensor]) -> str | None:
        """Swap freshly loaded private tensors in (disk loads), releasing any leases; None on
        success, else why not. Names and shapes were checked by the caller."""
        with self._both_locks() as busy:
            if busy:
                return busy
            targets = self.target_map()
            for name, t in state.items():
                canonical, live = targets[name]
                self._swap_in(canonical, t.to(live.dtype).contiguous(), None)
        return None

    @contextmanager
    def _both_locks(self) -> Iterator[str | None]:
        """_update_lock then model_lock (the documented order), each within lock_timeout_s.
        Yields None while both are held, else why they could not be taken."""
        if not self._update_lock.acquire(timeout=self.lock_timeout_s):
            yield f"a weight update held the engine for {self.lock_timeout_s} s"
            return
        try:
            if not self.sched.model_lock.acquire(timeout=self.lock_timeout_s):
                yield f"model busy for {self.lock_timeout_s} s"
                return
            try:
                yield None
            finally:
                self.sched.model_lock.release()
        finally:
            self._update_lock.release()

    # ---- memory release (colocated placement; rules in core/engine/memory.py) ----
    def drop_weights(self) -> dict[str, tuple[torch.Size, torch.dtype]] | str:
        """Free every live tensor, shadow and lease; returns each canonical tensor's shape and
        dtype (to allocate it again), or why not."""
        with self._both_locks() as busy:
            if busy:
                return busy
            shapes: dict[str, tuple[torch.Size, torch.dtype]] = {}
            targets = self.target_map()
            for canonical in self._resume_order():
                live = targets[canonical][1]
                shapes[canonical] = (live.shape, live.dtype)
                live.data = torch.empty(0, dtype=live.dtype, device=live.device)
                lease = self._live_leases.pop(canonical, None)
                if lease is not None:
                    lease.release()
            self._shadows.clear()
            self.forget_commit_plan()
            self.cuda.clear()  # plans' shadows, and the trainer's storages the last push did not read
            self.epoch += 1
            self.generation += 1
            return shapes

    def _resume_order(self) -> list[str]:
        """Every canonical name, in the order the last committed push of every tensor sent them
        (the model's order before one): allocate_weights lays the weights out in this order.
        Why: the next push (colocated placement's, into the resumed weights) then writes each
        run of its buckets as one span copy (packing.BucketCopy) where the trainer's order is not
        the model's (Megatron's). On the lent H100 a 3.4 GB push in Megatron's order written
        tensor by tensor into resumed weights took 10.1 ms; one in the model's order, one span a
        bucket, 5.2 ms (bench/results/cuda_ipc_sync_3gb.txt, 12-06). Timed with this order on
        12-07, every layout's load took 10.5 ms: the copy plan made per tensor after each resume
        (packing.BucketCopy now plans from addresses; not yet re-timed)."""
        canonicals = self._canonicals()
        known = set(canonicals)
        sent = [c for c in self._push_order if c in known]
        chosen = set(sent)
        return sent + [c for c in canonicals if c not in chosen]

    def _canonicals(self) -> list[str]:
        """Every canonical name (a tied tensor once), in the model's order."""
        return [name for name, (canonical, _) in self.target_map().items() if name == canonical]

    def allocate_weights(self, shapes: dict[str, tuple[torch.Size, torch.dtype]]) -> None:
        """Give every dropped tensor uninitialised memory again; each stays in `unloaded`
        until an update (disk, tensor or distributed) fills it."""
        with self._update_lock, self.sched.model_lock:
            targets = self.target_map()
            # back to back again (packing.py), in drop_weights' order (_resume_order): pushes and
            # commits stay a few span copies
            allocate_packed([(targets[canonical][1], shape, dtype) for canonical, (shape, dtype) in shapes.items()])
            self.unloaded = set(shapes)
            self.epoch += 1
            self.generation += 1

    def run_update(self, work: Any, flush_cache: bool, version: Any) -> Reply:
        """Run one update call `work()` inside the open session; any failure poisons it."""
        with self._lock:
            if self._session is None:
                return 400, "no weight-update session is open: call /begin_weight_update first"
            if self._session.failed:
                return 400, f"this session already failed ({self._session.failed}); end it and begin again"
        if flush_cache and self.sched.num_running():
            return self._fail("cannot flush cache while requests are running: pause first", 400)
        if not self._update_lock.acquire(timeout=self.lock_timeout_s):
            return self._fail(f"another update call held the engine for {self.lock_timeout_s} s", 409)
        try:
            message = work()
        except UpdateRejected as exc:
            return self._fail(str(exc), exc.status)
        except ValueError as exc:  # a malformed request (descriptor, dtype)
            return self._fail(str(exc), 400)
        except Exception as exc:  # any failure must leave the live weights untouched
            log.exception("weight update failed")
            return self._fail(f"{type(exc).__name__}: {exc}", 500)
        finally:
            self._update_lock.release()
        if version is not None:
            self.stage_version(str(version))
        with self._lock:
            if self._session is not None:
                self._session.touched_at = time.monotonic()
        return 200, message

    def _fail(self, message: str, status: int) -> Reply:
        with self._lock:
            if self._session is not None:
                self._session.failed = self._session.failed or message
        return status, f"{message}; the session will be discarded at /end_weight_update"
