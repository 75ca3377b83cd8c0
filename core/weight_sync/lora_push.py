"""LoRA weight sync: engines keep the base weights and load only the trainer's adapter.

The trainer exports a PEFT adapter folder (core/train/lora.py); every engine replaces its
adapter `ADAPTER_NAME` with it through SGLang's `/unload_lora_adapter` + `/load_lora_adapter`,
and rollouts name it with `lora_path` on /generate (`AdapterRequests`). The base weights are
never sent again: what moves per push is the adapter's safetensors file.

Sequence (DiskTransport's, with the adapter calls in place of the weight load):
pause → flush → unload (an engine without it is fine) → load → update_weight_version →
continue → check /model_info. Each step goes to all engines in parallel and must succeed on
all before the next. SGLang refuses to load a name that is loaded, hence unload first; the
engines are paused, so no request runs between the two. A failed attempt reloads the last
adapter that was pushed whole (`last_good`) on every engine before its `continue`, then is
retried up to `num_attempts` (not when an engine did not answer: retrying would only wait).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from milepost.core.fleet.client import EngineClient, EngineError, GenerationClient
from milepost.core.train.lora import ADAPTER_WEIGHTS, is_adapter_folder, read_adapter
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

ADAPTER_NAME = "policy"  # the one adapter a milepost fleet serves; rollouts send it as lora_path


def unload_body() -> dict[str, Any]:
    """SGLang's UnloadLoRAAdapterReqInput."""
    return {"lora_name": ADAPTER_NAME}


def load_body(path: str) -> dict[str, Any]:
    """SGLang's LoadLoRAAdapterReqInput (not pinned: one adapter, nothing to evict)."""
    return {"lora_name": ADAPTER_NAME, "lora_path": path, "pinned": False}


def replace_adapter(client: EngineClient, path: str, timeout_s: float) -> dict[str, Any]:
    """Unload the engine's adapter (if it has one) and load the folder `path` in its place."""
    try:
        client.unload_lora_adapter(unload_body(), timeout_s)
    except EngineError as exc:
        if exc.status is None or "does not exist" not in exc.message:
            raise
    return client.load_lora_adapter(load_body(path), timeout_s)


def load_served(client: EngineClient, path: str, version: str, timeout_s: float | None = None) -> dict[str, Any]:
    """Make one engine serve what a fleet served last (a restarted or woken engine): a PEFT
    adapter folder is loaded as the adapter, anything else as full weights from disk."""
    if not is_adapter_folder(path):
        return client.update_weights_from_disk(path, weight_version=version, timeout_s=timeout_s)
    reply = replace_adapter(client, path, timeout_s or client.timeout_s)
    if reply.get("success", False):
        client.update_weight_version(version, False, timeout_s=timeout_s)
    return reply


def full_weight_bytes(adapter_dir: str) -> float:
    """Bytes of the base model's safetensors (what a full-weight push would move), 0 if unknown."""
    config, _ = read_adapter(adapter_dir)
    base = Path(str(config.get("base_model_name_or_path", "")))
    return float(sum(f.stat().st_size for f in base.glob("*.safetensors"))) if base.is_dir() else 0.0


class AdapterRequests:
    """A client (the router's) whose /generate names the served adapter while `adapter()`
    returns one (before the first push a fleet serves the base model: no lora_path)."""

    def __init__(self, inner: GenerationClient, adapter: Callable[[], str | None]) -> None:
        self.inner, self.adapter = inner, adapter

    def generate(self, *args: Any, **kwargs: Any) -> Any:
        name = self.adapter()
        if name is not None:
            kwargs.setdefault("lora_path", name)
        return self.inner.generate(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


class LoraTransport:
    """Pushes the trainer's adapter folder (`export_dir`) to every engine (module docstring)."""

    name = "lora"
    reads_export = True
    release_tags = ("kv_cache",)  # colocated sleep keeps the base weights: no push would refill them

    def __init__(self, num_attempts: int = 2, timeout_s: float = 120.0, pause_mode: str = "abort",
                 cleanup_timeout_s: float = 5.0) -> None:
        self.num_attempts, self.timeout_s, self.pause_mode = max(1, num_attempts), timeout_s, pause_mode
        self.cleanup_timeout_s = min(cleanup_timeout_s, timeout_s)
        self.last_good: str | None = None
        self._full_bytes: float | None = None

    def push(self, clients: list[EngineClient], export_dir: str, version: str,
             backend: WeightSource | None = None) -> dict[str, float]:
        """`backend` is not used: the adapter is the folder `export_dir`."""
        if not is_adapter_folder(export_dir):
            raise WeightSyncError(f"train.lora pushes a PEFT adapter folder; {export_dir} is not one (no "
                                  "adapter_config.json): was the trainer started without train.lora?", retryable=False)
        start = time.perf_counter()
        for attempt in range(1, self.num_attempts + 1):
            try:
                self._attempt(clients, export_dir, version)
                break
            except Exception as e:  # retried, then raised
                log.warning("LoRA adapter push attempt %d/%d failed: %s", attempt, self.num_attempts, e)
                if no_reply(e) or attempt == self.num_attempts:
                    raise WeightSyncError(
                        f"engines did not take adapter version {version} from {export_dir} after {attempt} "
                        f"attempt(s): {e}. Engines were given back adapter {self.last_good} (the last one "
                        "pushed whole); check the engine logs.", retryable=False) from e
        self.last_good = export_dir
        if self._full_bytes is None:
            self._full_bytes = full_weight_bytes(export_dir)
        nbytes = float((Path(export_dir) / ADAPTER_WEIGHTS).stat().st_size)
        return {"sync/seconds": time.perf_counter() - start, "sync/attempts": float(attempt),
                "sync/bytes": nbytes, "sync/full_weight_bytes": self._full_bytes}

    def close(self) -> None:
        """Nothing to release: the export folder belongs to the caller."""

    def _attempt(self, clients: list[EngineClient], export_dir: str, version: str) -> None:
        deadline = Deadline(self.timeout_s, f"LoRA adapter push of policy version {version}")
        push_id, committed = uuid.uuid4().hex, False
        pool = ThreadPoolExecutor(max_workers=len(clients) + 1, thread_name_prefix="lora-sync")
        try:
            on_engines(pool, clients, "pause_generation",
                       lambda c: c.pause(self.pause_mode, timeout_s=deadline.left(), push_id=push_id), deadline)
            if self.pause_mode != "in_place":
                on_engines(pool, clients, "flush_cache", lambda c: c.flush_cache(timeout_s=deadline.left()), deadline)
            on_engines(pool, clients, "load_lora_adapter",
                       lambda c: replace_adapter(c, export_dir, deadline.left()), deadline)
            on_engines(pool, clients, "update_weight_version",
                       lambda c: c.update_weight_version(version, False, timeout_s=deadline.left()), deadline)
            committed = True
        finally:
            best_effort(pool, clients, self.cleanup_timeout_s + (0.0 if committed else self.timeout_s),
                        lambda c, d: self._cleanup(c, d, push_id, committed))
            pool.shutdown(wait=False, cancel_futures=True)
        verify_versions(clients, version, max(self.cleanup_timeout_s, 1.0))

    def _cleanup(self, client: EngineClient, deadline: Deadline, push_id: str, committed: bool) -> None:
        if not committed and self.last_good is not None:  # never leave an engine without an adapter
            try:
                replace_adapter(client, self.last_good, deadline.left())
            except Exception as exc:  # reported; continue must still be sent
                if isinstance(exc, EngineError) and exc.status is None:
                    raise  # no reply (a connection the engine closed): best_effort runs this cleanup again
                log.warning("restoring adapter %s on %s failed: %s", self.last_good, client.base_url, exc)
        client.continue_generation(timeout_s=deadline.left(), push_id=push_id)
