"""Weight sync: make every engine serve the trainer's newest policy.

Ordering rule (SGLang's, for every transport): pause → flush → send weights (with the new
`weight_version`) → continue. Every call has a timeout. If any engine fails, the sync is
retried from the start up to `num_attempts` times; after that `WeightSyncError` fails the
stage. An engine is never left paused: `continue` is sent in a finally block.

Transports share this interface; `disk` exists now, `tensor` and `distributed` come with
the async work.
"""

from __future__ import annotations

import logging
import time
from typing import Protocol

from milepost.core.engine.client import EngineClient

log = logging.getLogger(__name__)


class WeightSyncError(RuntimeError):
    pass


class WeightTransport(Protocol):
    name: str

    def push(self, clients: list[EngineClient], export_dir: str, version: str) -> dict[str, float]:
        """Make every engine serve the weights in `export_dir` as `version`; return metrics."""
        ...


class DiskTransport:
    """The trainer has written an HF folder; each engine loads it with /update_weights_from_disk."""

    name = "disk"

    def __init__(self, num_attempts: int = 2) -> None:
        self.num_attempts = num_attempts

    def push(self, clients: list[EngineClient], export_dir: str, version: str) -> dict[str, float]:
        start = time.perf_counter()
        last_error: Exception | None = None
        for attempt in range(1, self.num_attempts + 1):
            try:
                for client in clients:
                    self._push_one(client, export_dir, version)
                break
            except Exception as e:  # noqa: BLE001 - any engine failure is retried, then raised
                last_error = e
                log.warning("weight sync attempt %d/%d failed: %s", attempt, self.num_attempts, e)
        else:
            raise WeightSyncError(
                f"engines did not take policy version {version} from {export_dir} after "
                f"{self.num_attempts} attempts: {last_error}. Check the engine logs; the fleet "
                "still serves the previous version."
            )
        seconds = time.perf_counter() - start
        return {"sync/seconds": seconds, "sync/attempts": float(attempt)}

    @staticmethod
    def _push_one(client: EngineClient, export_dir: str, version: str) -> None:
        client.pause("abort")
        try:
            client.flush_cache()
            reply = client.update_weights_from_disk(export_dir, weight_version=version)
            if not reply.get("success", False):
                raise WeightSyncError(f"{client.base_url}: {reply.get('message')}")
        finally:
            client.continue_generation()
        served = str(client.model_info().get("weight_version"))
        if served != version:
            raise WeightSyncError(f"{client.base_url} serves version {served}, expected {version}")


def build_transport(name: str) -> WeightTransport:
    if name == "disk":
        return DiskTransport()
    raise ValueError(f"sync.transport `{name}` is not available; use `disk`")
