"""`disk` transport: the trainer has written an HF folder; each engine loads it with
/update_weights_from_disk (no session needed)."""

from __future__ import annotations

import time
import uuid
from concurrent.futures import ThreadPoolExecutor

from milepost.core.fleet.client import EngineClient
from milepost.core.weight_sync.base import (
    Deadline,
    WeightSource,
    WeightSyncError,
    best_effort,
    log,
    no_reply,
    on_engines,
    verify_versions,
)


class DiskTransport:
    """pause → flush → update_weights_from_disk (with the new weight_version) → continue →
    check /model_info. Each step goes to all engines in parallel and must succeed on all
    before the next, so an engine that does not answer the pause stops the push before any
    engine loads. `continue` is always sent (within `cleanup_timeout_s`). Every call's
    timeout is what is left of the attempt's `timeout_s`. A failed attempt is retried up to
    `num_attempts`, except when an engine did not answer (retrying would only wait again);
    then WeightSyncError fails the stage. Loads are not atomic across engines: if one fails
    while another succeeds, they serve different versions until the retry."""

    name = "disk"
    reads_export = True

    def __init__(self, num_attempts: int = 2, timeout_s: float = 120.0, pause_mode: str = "abort",
                 cleanup_timeout_s: float = 5.0) -> None:
        self.num_attempts, self.timeout_s, self.pause_mode = max(1, num_attempts), timeout_s, pause_mode
        self.cleanup_timeout_s = min(cleanup_timeout_s, timeout_s)

    def push(self, clients: list[EngineClient], export_dir: str, version: str,
             backend: WeightSource | None = None) -> dict[str, float]:
        """`backend` is not used: the weights are the files in `export_dir`."""
        start = time.perf_counter()
        for attempt in range(1, self.num_attempts + 1):
            try:
                self._attempt(clients, export_dir, version)
                break
            except Exception as e:  # any engine failure is retried, then raised
                log.warning("disk weight sync attempt %d/%d failed: %s", attempt, self.num_attempts, e)
                if no_reply(e) or attempt == self.num_attempts:
                    raise WeightSyncError(
                        f"engines did not take policy version {version} from {export_dir} after "
                        f"{attempt} attempt(s): {e}. Check the engine logs; engines that did not "
                        "load still serve the previous version.", retryable=False) from e
        seconds = time.perf_counter() - start
        return {"sync/seconds": seconds, "sync/attempts": float(attempt)}

    def close(self) -> None:
        """Nothing to release: the export folder belongs to the caller."""

    def _attempt(self, clients: list[EngineClient], export_dir: str, version: str) -> None:
        deadline = Deadline(self.timeout_s, f"disk push of policy version {version}")
        push_id = uuid.uuid4().hex  # pause and continue of this attempt: a late pause is ignored
        flush = self.pause_mode != "in_place"
        pool = ThreadPoolExecutor(max_workers=len(clients) + 1, thread_name_prefix="weight-sync")
        try:
            on_engines(pool, clients, "pause_generation",
                       lambda c: c.pause(self.pause_mode, timeout_s=deadline.left(), push_id=push_id), deadline)
            if flush:
                on_engines(pool, clients, "flush_cache", lambda c: c.flush_cache(timeout_s=deadline.left()), deadline)
            on_engines(pool, clients, "update_weights_from_disk", lambda c: c.update_weights_from_disk(
                export_dir, weight_version=version, flush_cache=flush, timeout_s=deadline.left()), deadline)
        finally:
            best_effort(pool, clients, self.cleanup_timeout_s,
                        lambda c, d: c.continue_generation(timeout_s=d.left(), push_id=push_id))
            pool.shutdown(wait=False, cancel_futures=True)
        verify_versions(clients, version, max(self.cleanup_timeout_s, 1.0))
