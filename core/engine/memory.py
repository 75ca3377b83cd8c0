"""Memory release for colocated placement: `/release_memory_occupation` and
`/resume_memory_occupation` of the built-in engine (SGLang's endpoints and tags).

When trainer and engines share devices, engines give their memory back while the trainer
runs, and take it again before the next weight push. The weights are freed for real on
every device, and with them what the engine derives from them (an int4 engine's packed
values and scales, quantized.py). On the fast path (fast_path.py) the static KV cache (`kv_cache`) and the
captured CUDA graphs (`cuda_graph`) are freed too, the allocator's cache is emptied, and
the answer says how much device memory the engine gave back and still holds. The HF path
keeps no KV cache between batches and has no graphs: those tags have nothing to free there.

Rules (enforced here):
- Release only while idle: no request running or queued (pause, or let the rollout end),
  and no weight-update session open. A short request (a health check) is waited for, up to
  IDLE_WAIT_S; otherwise 400, nothing released.
- While the weights are released, generation and health_generate answer 503 naming the
  state, and weight updates are refused (resume first: there is nothing to load into).
- Resume allocates the tensors again *without content*: the engine serves again only once
  an update (disk, tensor or distributed) has filled every tensor. Until then generation
  answers 503 "push weights"; /model_info still names the last version it served.
"""

from __future__ import annotations

import threading
import time
from typing import TYPE_CHECKING, Any

import torch

from milepost.core.engine.quantized import forget_int4
from milepost.core.engine.weight_receiver import Reply

if TYPE_CHECKING:  # types only: the scheduler imports the parts of the engine
    from milepost.core.engine.scheduler import Scheduler

TAGS = ("weights", "kv_cache", "cuda_graph")
IDLE_WAIT_S = 5.0


def parse_tags(body: dict[str, Any]) -> list[str] | str:
    """The request's `tags` (default: all), or what is wrong with them."""
    tags = body.get("tags")
    if tags is None:
        return list(TAGS)
    if not isinstance(tags, list) or not all(isinstance(t, str) for t in tags):
        return "`tags` must be a list of strings"
    unknown = sorted(set(tags) - set(TAGS))
    return f"unknown tags {unknown}; use some of {list(TAGS)}" if unknown else tags


class MemoryOccupation:
    """Which memory the engine has given back; `lock` serialises release and resume."""

    def __init__(self, sched: Scheduler) -> None:
        self.sched = sched
        self.lock = threading.Lock()
        self.released: set[str] = set()
        self._shapes: dict[str, tuple[torch.Size, torch.dtype]] | None = None

    def release(self, tags: list[str]) -> Reply:
        with self.lock:
            deadline = time.monotonic() + IDLE_WAIT_S
            while (busy := self.sched.busy_reason()) and time.monotonic() < deadline:
                time.sleep(0.05)
            if busy:
                return 400, f"cannot release memory: {busy}"
            if self.sched.receiver.in_session():
                return 400, "cannot release memory while a weight-update session is open: end it first"
            held = _device_bytes()
            if "weights" in tags and "weights" not in self.released:
                shapes = self.sched.receiver.drop_weights()
                if isinstance(shapes, str):
                    return 503, shapes
                self._shapes = shapes
                forget_int4(self.sched.model)  # derived from the weights (quantized.py): freed with them
            decoder = self._decoder()
            if decoder is not None:
                if "kv_cache" in tags:
                    decoder.release()
                if {"cuda_graph", "weights"} & set(tags):
                    decoder.drop_graphs()
            self.released |= set(tags)
            return 200, f"released {sorted(tags)}{_freed(held)}"

    def resume(self, tags: list[str]) -> Reply:
        with self.lock:
            if "weights" in tags and "weights" in self.released and self._shapes is not None:
                self.sched.receiver.allocate_weights(self._shapes)
                self._shapes = None
            decoder = self._decoder()
            if decoder is not None and "kv_cache" in tags:
                decoder.allocate()
            self.released -= set(tags)
            unloaded = len(self.sched.receiver.unloaded)
            tail = f"; {unloaded} tensors wait for a weight update before serving" if unloaded else ""
            return 200, f"resumed {sorted(tags)}{tail}"

    def _decoder(self) -> Any:
        driver = getattr(self.sched, "driver", None)
        return None if driver is None else driver.gen.decoder

    def serving_problem(self) -> str | None:
        """Why the engine cannot generate now, or None."""
        if "weights" in self.released:
            return "weights are released (/release_memory_occupation): resume them and push weights first"
        if "kv_cache" in self.released and self._decoder() is not None:
            return "the KV cache is released (/release_memory_occupation): resume it first"
        if self.sched.receiver.unloaded:
            return (f"{len(self.sched.receiver.unloaded)} weight tensors are not loaded since "
                    "/resume_memory_occupation: push weights first")
        return None

    def update_problem(self) -> str | None:
        """Why a weight update cannot run now, or None."""
        if "weights" in self.released:
            return "weights are released: call /resume_memory_occupation with tag `weights` first"
        return None


def _device_bytes() -> int:
    """Device memory this process's allocator holds (0 without CUDA)."""
    return torch.cuda.memory_reserved() if torch.cuda.is_available() and torch.cuda.is_initialized() else 0


def _freed(held_before: int) -> str:
    """'; freed X GiB of device memory, Y GiB still held' after emptying the allocator's cache."""
    if not held_before:
        return ""
    torch.cuda.empty_cache()
    held = _device_bytes()
    return f"; freed {(held_before - held) / 2**30:.2f} GiB of device memory, {held / 2**30:.2f} GiB still held"
