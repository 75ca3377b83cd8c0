"""SessionTransport: SGLang's begin/end sequence with timeouts and bounded retries; the
tensor and distributed transports fill in `_send`."""

from __future__ import annotations

import logging
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from milepost.core.fleet.client import EngineClient
from milepost.core.weight_sync.base import (
    Deadline,
    WeightSource,
    WeightSyncError,
    best_effort,
    no_reply,
    on_engines,
    result,
    verify_versions,
)

log = logging.getLogger("milepost.weight_sync")
PAUSE_MODES = ("abort", "retract", "in_place")
RESTORE_MODES = ("auto", "always", "never")


class SessionTransport:
    """Push = pause → flush → begin → `_send` → update_weight_version → end → continue.

    Rules: every step goes to all engines in parallel and must succeed on all before the
    next starts. Each attempt has `timeout_s` in all; every call's timeout is what is left
    of it. On failure, open sessions are aborted (the engine discards staged weights),
    `continue` is sent to every engine and the trainer side is cleaned up, all within one
    `cleanup_timeout_s` window; then the attempt is retried up to `num_attempts`, unless an
    engine or the trainer did not answer (retrying would only wait again): then
    WeightSyncError at once. So a push ends within about num_attempts × (timeout_s +
    cleanup_timeout_s), one attempt's worth when something did not answer; it never hangs
    and never leaves a reachable engine paused. One push at a time per transport object.
    The pause and the continue of one attempt carry one `push_id`: an engine that was
    stopped and gets the attempt's pause only after its continue ignores that pause.

    Restore rule (SGLang loads each bucket as it arrives, so an attempt that fails after
    begin leaves it on a mix of old and new weights): before its `continue`, every such
    engine reloads the last good weights — the export of the last push that committed
    (`last_good`: its export_dir and version; the loop exports every pushed policy, behind
    the push, finishes that export before its next train step, and keeps that folder until
    the next one is written) — with /update_weights_from_disk,
    within `timeout_s`. Which engines: `restore` "auto" (those whose /server_info does not
    announce `end_weight_update_abort`; the built-in engine discards an aborted session and
    keeps serving its old weights whole), "always" or "never". The failure's message says
    what was restored (or that nothing could be: no push committed yet), and
    `sync/restored_engines` counts them in the metrics of a push that succeeded later.
    """

    name = "session"
    reads_export = False  # export_dir is only where the loop will write this version (restore)

    def __init__(self, timeout_s: float = 120.0, bucket_mb: float = 512.0, num_attempts: int = 2,
                 pause_mode: str = "abort", cleanup_timeout_s: float = 5.0, restore: str = "auto") -> None:
        if pause_mode not in PAUSE_MODES:
            raise ValueError(f"pause_mode `{pause_mode}`: use one of {', '.join(PAUSE_MODES)}")
        if restore not in RESTORE_MODES:
            raise ValueError(f"restore `{restore}`: use one of {', '.join(RESTORE_MODES)}")
        self.restore = restore
        self.last_good: tuple[str, str] | None = None  # (export dir, version) of the last committed push
        self._restored: dict[str, str] = {}  # engine url → what its restore did, this attempt
        self.timeout_s, self.bucket_mb, self.num_attempts = timeout_s, bucket_mb, max(1, num_attempts)
        self.pause_mode, self.cleanup_timeout_s = pause_mode, min(cleanup_timeout_s, timeout_s)
        self.backend: WeightSource | None = None
        self._plan: tuple[int, list[list[dict[str, Any]]]] | None = None  # (id(backend), buckets)

    def push(self, clients: list[EngineClient], export_dir: str, version: str,
             backend: WeightSource | None = None) -> dict[str, float]:
        """Send the trainer's live weights (`export_dir` is not read) as `version`."""
        if backend is None:
            raise ValueError(f"sync.transport `{self.name}` sends from the trainer's memory: "
                             "call push(..., backend=<the train backend>)")
        self.backend = backend
        start, restored = time.perf_counter(), 0
        for attempt in range(1, self.num_attempts + 1):
            try:
                nbytes, send_s = self._attempt(clients, version, backend)
                break
            except Exception as exc:  # every failure is retried or reported
                log.warning("%s weight sync attempt %d/%d failed: %s%s", self.name, attempt, self.num_attempts, exc,
                            self._restore_note())
                restored += sum(note.startswith("restored") for note in self._restored.values())
                retryable = exc.retryable if isinstance(exc, WeightSyncError) else not no_reply(exc)
                if not retryable or attempt == self.num_attempts:
                    raise WeightSyncError(
                        f"engines did not take policy version {version} through the {self.name} transport "
                        f"({attempt} attempt(s)): {exc}. Engines that were reached still serve their "
                        f"previous version{self._restore_note()}; check the logs of the engines named.",
                        retryable=False) from exc
        if export_dir:
            self.last_good = (export_dir, version)
        seconds = time.perf_counter() - start
        return {"sync/seconds": seconds, "sync/send_seconds": send_s, "sync/bytes": float(nbytes),
                "sync/gb_per_s": nbytes / seconds / 1e9, "sync/attempts": float(attempt),
                "sync/restored_engines": float(restored)}

    def _restore_note(self) -> str:
        if not self._restored:
            return ""
        return " (" + "; ".join(f"{url}: {note}" for url, note in sorted(self._restored.items())) + ")"

    def _attempt(self, clients: list[EngineClient], version: str, backend: WeightSource) -> tuple[int, float]:
        deadline = Deadline(self.timeout_s, f"{self.name} push of policy version {version}")
        pool = ThreadPoolExecutor(max_workers=2 * len(clients) + 4, thread_name_prefix="weight-sync")
        opened = committed = False
        push_id = uuid.uuid4().hex  # pause and continue of this attempt: a late pause is ignored
        self._restored = {}
        try:
            self._prepare(pool, clients, backend, deadline)
            on_engines(pool, clients, "pause_generation",
                       lambda c: c.pause(self.pause_mode, timeout_s=deadline.left(), push_id=push_id), deadline)
            if self.pause_mode != "in_place":  # in_place keeps requests (and their cache) alive
                on_engines(pool, clients, "flush_cache", lambda c: c.flush_cache(timeout_s=deadline.left()), deadline)
            opened = True  # a begin that timed out may still have opened a session
            on_engines(pool, clients, "begin_weight_update",
                       lambda c: c.begin_weight_update("all", timeout_s=deadline.left()), deadline)
            t0 = time.perf_counter()
            nbytes = self._send(pool, clients, backend, deadline)
            send_s = time.perf_counter() - t0
            # abort_all_requests=False: retracted requests wait in the queue for the new weights
            on_engines(pool, clients, "update_weight_version",
                       lambda c: c.update_weight_version(version, False, timeout_s=deadline.left()), deadline)
            on_engines(pool, clients, "end_weight_update",
                       lambda c: c.end_weight_update(timeout_s=deadline.left()), deadline)
            committed = True
        finally:  # the trainer's and the engines' cleanup share one cleanup window
            cleanup_end = time.monotonic() + self.cleanup_timeout_s
            trainer = None if committed else pool.submit(self._on_failure, backend)
            # after a commit the version check needs no paused engine: it runs beside continue
            check = pool.submit(verify_versions, clients, version, self.cleanup_timeout_s, pool) if committed else None
            restoring = opened and not committed and self.restore != "never"
            best_effort(pool, clients, self.cleanup_timeout_s + (self.timeout_s if restoring else 0.0),
                        lambda c, d: self._cleanup(c, d, push_id, opened and not committed, not committed))
            if trainer is not None:
                try:
                    trainer.result(timeout=max(0.1, cleanup_end - time.monotonic()))
                except Exception as exc:  # noqa: BLE001 - logged; the attempt already failed
                    log.warning("%s cleanup on the trainer: %s", self.name, exc)
            try:
                if check is not None:
                    result(check, Deadline(self.cleanup_timeout_s, "version check"), "version check")
            finally:
                pool.shutdown(wait=False, cancel_futures=True)
        return nbytes, send_s

    def _cleanup(self, client: EngineClient, deadline: Deadline, push_id: str, end_session: bool,
                 failed: bool) -> None:
        """One engine's cleanup: abort an open session (the engine discards what it staged),
        continue, then the transport's own engine-side cleanup."""
        if end_session:
            try:
                client.end_weight_update(abort=True, timeout_s=deadline.left())
            except Exception as exc:  # noqa: BLE001 - may have no session: continue anyway
                log.info("ending the session on %s: %s", client.base_url, exc)
            self._restore_engine(client, deadline)
        client.continue_generation(timeout_s=deadline.left(), push_id=push_id)
        if failed:
            self._engine_failure_cleanup(client, deadline)

    def _restore_engine(self, client: EngineClient, deadline: Deadline) -> None:
        """The restore rule (class docstring), on one engine whose session was aborted."""
        try:
            if self.restore == "never" or (self.restore == "auto" and client.announces(
                    "end_weight_update_abort", timeout_s=deadline.left())):
                return
            if self.last_good is None:
                self._restored[client.base_url] = ("NOT restored: no push committed yet, so no export of good weights "
                                                   "is known; it may serve a mix of weights until the next push")
                return
            path, version = self.last_good
            client.update_weights_from_disk(path, weight_version=version, flush_cache=False,
                                            timeout_s=deadline.left())
            self._restored[client.base_url] = f"restored version {version} from {path}"
        except Exception as exc:  # noqa: BLE001 - reported with the failure
            self._restored[client.base_url] = f"restore FAILED ({exc}): it may serve a mix of weights"
        log.warning("after a failed push, %s: %s", client.base_url, self._restored.get(client.base_url))

    def plan(self, backend: WeightSource, deadline: Deadline) -> list[list[dict[str, Any]]]:
        """The trainer's bucket plan; names, shapes and dtypes do not change during a run, so
        it is asked once per backend."""
        if self._plan is None or self._plan[0] != id(backend):
            self._plan = (id(backend), backend.weight_buckets(self.bucket_mb, timeout_s=deadline.left()))
        return self._plan[1]

    # ---- what a transport fills in ----
    def _prepare(self, pool: ThreadPoolExecutor, clients: list[EngineClient], backend: WeightSource,
                 deadline: Deadline) -> None:
        """Before pausing (e.g. join a process group)."""

    def _send(self, pool: ThreadPoolExecutor, clients: list[EngineClient], backend: WeightSource,
              deadline: Deadline) -> int:
        """Send every bucket inside the open sessions; return the bytes sent."""
        raise NotImplementedError

    def _engine_failure_cleanup(self, client: EngineClient, deadline: Deadline) -> None:
        """After a failed attempt, on each engine, within the cleanup deadline."""

    def _on_failure(self, backend: WeightSource) -> None:
        """After a failed attempt, on the trainer (e.g. drop a process group)."""

    def close(self) -> None:
        """Release what the transport holds on the trainer and engines."""

