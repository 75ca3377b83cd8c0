"""The HF exports of pushed policies: what a restarted engine loads (fleet.served), written
by the loop after each train step, for transports that push from the trainer's memory while
the next rollout runs.

Why behind the push: on an H100, gpu-arith's CUDA-IPC push took 0.026 s a step and the
export before it 0.097 s (bench/results/gpu_arith_h100_tensor_run2.txt); at 1.7 B
parameters the export writes 3.4 GB a step. Transports that read the trainer's memory
(`tensor`, `distributed`) do not need the folder, so it is written while the next rollout
runs (`behind`); `disk` and `lora` read it, so theirs is written before the push (`write`).

Rules (each enforced here or by the caller named):
- A folder exists under its final name only once complete: an export writes into
  `<name>.partial` and renames it, so a kill mid-export never leaves a folder that looks
  whole (`prune` removes what a kill left).
- At most one export runs; the trainer's weights must not change while it does: the loop
  calls `wait()` before its next train step and before a checkpoint (RLLoop).
- Whoever loads a served folder from disk first calls `wait_for(path)` (FleetSupervisor's
  admission of a restarted engine, FleetTransport.wake(reload)). An export that failed
  raises there and at the loop's next `wait()`, with the folder and the cause.
- `durable(path)`: whether `path` may be recorded where another process reads it (the
  fleet's store record): a stage that dies mid-export must not leave that record pointing
  at a folder never completed.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from pathlib import Path

PARTIAL = ".partial"
log = logging.getLogger("milepost.weight_export")


class ExportError(RuntimeError):
    """An export that failed or did not finish in time; names the folder and the cause."""


class WeightExports:
    """Exports of the trainer's weights into `root/<step:08d>` by `export(path)` (the train
    backend's `export_hf`). One export at a time; `write` is synchronous, `behind`
    exports after a push, in the background (module docstring)."""

    def __init__(self, root: Path, export: Callable[[str], None]) -> None:
        self.root, self._export = Path(root), export
        self._lock = threading.Lock()
        self._pending: tuple[str, Future[float]] | None = None  # (final path, seconds it took)
        self._pool: ThreadPoolExecutor | None = None
        self._listeners: list[Callable[[str], None]] = []
        self._unreported_s: float | None = None  # a background export's seconds, until reported
        self._completed: str | None = None  # the last folder this object wrote whole (link_into)

    def path_of(self, step: int) -> Path:
        return self.root / f"{step:08d}"

    def write(self, step: int) -> tuple[Path, float]:
        """Export step `step`'s weights now; (its folder, seconds)."""
        self.wait()
        path = self.path_of(step)
        return path, self._write(str(path))

    @contextlib.contextmanager
    def behind(self, step: int) -> Iterator[Path]:
        """Export step `step`'s weights after the body (the push) succeeds, in the background.
        The folder counts as pending from entry, so a restarted engine admitted while the
        push records it waits for it (`wait_for`); a body that raises withdraws it. The
        caller must not change the weights before `wait()` returns."""
        self.wait()
        path = str(self.path_of(step))
        reserved: Future[float] = Future()
        reserved.add_done_callback(lambda done: self._finished(path, done))
        with self._lock:
            self._pending = (path, reserved)
        try:
            yield Path(path)
        except BaseException as e:
            reserved.set_exception(ExportError(f"no export into {path}: the push it follows failed ({e})"))
            with self._lock:
                self._pending = None
            raise
        with self._lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="milepost-export")
            self._pool.submit(self._fill, path, reserved)

    def _fill(self, path: str, reserved: Future[float]) -> None:
        if not reserved.set_running_or_notify_cancel():
            return
        try:
            reserved.set_result(self._write(path))
        except BaseException as e:  # noqa: BLE001 - handed to whoever waits for it
            reserved.set_exception(e)

    def _write(self, path: str) -> float:
        started = time.perf_counter()
        final, partial = Path(path), Path(path + PARTIAL)
        shutil.rmtree(partial, ignore_errors=True)
        self._export(str(partial))
        shutil.rmtree(final, ignore_errors=True)  # a retried step's earlier export of the same step
        partial.rename(final)
        with self._lock:
            self._completed = path
        return time.perf_counter() - started

    def link_into(self, step: int, dest: Path) -> bool:
        """Make `dest` (absent) hold the files of step `step`'s export by hard links, when this
        object wrote that export whole (so it is of the weights the trainer holds while it
        does not train: the loop checkpoints after the step's push, before the next step) and
        the filesystem allows it; False, with nothing left at `dest`, otherwise (the caller
        exports afresh). Why: a checkpoint held a second export of the same weights, 3.4 GB
        written again at the Qwen3-1.7B shape. Safe because an export is never written after
        its rename: removing it later (pruning) leaves the checkpoint's links whole."""
        self.wait()
        source = self.path_of(step)
        with self._lock:
            written = self._completed == str(source)
        if not written or not source.is_dir():
            return False
        try:
            for path in source.rglob("*"):
                target = dest / path.relative_to(source)
                if path.is_dir():
                    target.mkdir(parents=True, exist_ok=True)
                else:
                    target.parent.mkdir(parents=True, exist_ok=True)
                    os.link(path, target)
        except OSError as e:  # another filesystem, no hard links there, a folder pruned meanwhile
            log.info("the checkpoint exports the weights afresh: linking %s failed (%s)", source, e)
            shutil.rmtree(dest, ignore_errors=True)
            return False
        return True

    def _finished(self, path: str, done: Future[float]) -> None:
        """After a background export (waiters are woken first): tell the listeners, then
        remove the exports before it; no one loads those now."""
        if done.cancelled() or done.exception() is not None:
            return
        for listener in list(self._listeners):
            listener(path)
        self._remove_all_but(Path(path))

    def on_written(self, listener: Callable[[str], None]) -> None:
        """Call `listener(path)` after each background export completes, once its waiters
        are woken (so a listener may take a lock a waiter holds)."""
        self._listeners.append(listener)

    def pending(self) -> str | None:
        """The folder reserved (`behind`) or being written now, if any."""
        with self._lock:
            return self._pending[0] if self._pending and not self._pending[1].done() else None

    def durable(self, path: str) -> bool:
        """`path` is no export still being written (or one that failed) by this object."""
        with self._lock:
            if self._pending is None or self._pending[0] != path:
                return True
            future = self._pending[1]
        return future.done() and future.exception() is None

    def wait(self, timeout_s: float | None = None) -> float | None:
        """Wait for the export in flight; the seconds it took, None if there was none.
        Raises ExportError if it failed or `timeout_s` passed (it keeps running then)."""
        with self._lock:
            pending = self._pending
        if pending is None:
            return None
        path, future = pending
        try:
            seconds = future.result(timeout=timeout_s)
        except FutureTimeout:
            raise ExportError(f"the export of the trainer's weights into {path} did not finish within "
                              f"{timeout_s:.0f} s; is its disk full or slow?") from None
        except Exception as e:
            raise ExportError(f"the export of the trainer's weights into {path} failed: {type(e).__name__}: "
                              f"{e}. Engines restarted from now on cannot load the served policy; check "
                              "that disk's space and permissions, then resume the run.") from e
        with self._lock:
            if self._pending is pending:
                self._pending = None
                self._unreported_s = seconds
        return seconds

    def report_behind(self) -> float | None:
        """The seconds of the background export finished since the last call (None: none)."""
        with self._lock:
            seconds, self._unreported_s = self._unreported_s, None
        return seconds

    def wait_for(self, path: str, timeout_s: float | None = None) -> None:
        """Return once `path` can be loaded: at once unless it is the export in flight."""
        with self._lock:
            pending = self._pending
        if pending is not None and pending[0] == path:
            self.wait(timeout_s)

    def prune(self, keep: Path) -> None:
        """After a push of `keep` (written by `write`) committed: remove every other export,
        and folders a killed export left half-written. (`behind` prunes by itself once its
        folder is complete: until then the one before is what the fleet's record names.)"""
        if self.pending() is None:
            self._remove_all_but(keep)

    def _remove_all_but(self, keep: Path) -> None:
        pending = self.pending()
        for old in self.root.glob("*"):
            if pending is not None and str(old).startswith(pending):
                continue  # an export started since (this runs late, in a done callback)
            complete = old.name.isdigit()
            if old != keep and (complete or old.name.endswith(PARTIAL)):
                shutil.rmtree(old, ignore_errors=True)

    def close(self) -> None:
        """Wait for the export in flight and stop the thread (before the trainer stops). Its
        error is not raised here: the loop raises it (RLLoop waits before each train step and
        at the end of `run_until`); a stage ending on another error only logs it."""
        try:
            self.wait()
        except ExportError as e:
            log.warning("%s", e)
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
