"""`tensor` transport (colocated): the trainer writes buckets into /dev/shm files, engines
take them through /update_weights_from_tensor (load_format flattened_bucket)."""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from milepost.core.fleet.client import EngineClient
from milepost.core.weight_sync import cuda_buffers, wire
from milepost.core.weight_sync.base import Deadline, WeightSource, log, on_engines, result
from milepost.core.weight_sync.session import SessionTransport


class TensorTransport(SessionTransport):
    """Formats, agreed per push from the engines' /server_info (`agree_format`): when every
    engine lists milepost's shm descriptor in `tensor_formats` (the built-in engine on CPU
    does), one copy per push: the trainer copies its weights into shared-memory files and
    the engine serves them in place (file ownership rules in wire's docstring). When every
    engine lists milepost's CUDA descriptor (the built-in engine on a GPU), CUDA storages
    mapped once and named by JSON (cuda_buffers). Any other engine (SGLang) gets
    SGLang's own format (sglang_wire: a pickled flattened bucket over shared memory, one
    entry per engine TP rank, `tp_size` from /server_info); the engine copies it in.

    Overlap: the first bucket is written while the engines pause, flush and begin (the
    trainer's own free files need no paused engine), and bucket i+1 while the engines take
    bucket i. The files stay on the trainer between pushes (no page faults after the first
    two); `close()` unlinks them. Engines must share the trainer's host (/dev/shm is per
    host). One push at a time per transport object (the writer state below is per push).
    """

    name = "tensor"

    def __init__(self, *args: Any, wire_format: str | None = None, **kwargs: Any) -> None:
        """`wire_format`: None agrees the format with the engines; "sglang" sends SGLang's
        to every engine (tests and bench/weight_sync.py compare the two)."""
        super().__init__(*args, **kwargs)
        if wire_format not in (None, "sglang"):
            raise ValueError(f"wire_format `{wire_format}`: use None (agreed with the engines) or sglang")
        self.wire_format = wire_format

    def _prepare(self, pool: ThreadPoolExecutor, clients: list[EngineClient], backend: WeightSource,
                 deadline: Deadline) -> None:
        plan = self.plan(backend, deadline)
        sizes = [wire.offsets(b)[1] for b in plan]
        self._bytes, buffer_bytes = sum(sizes), max(sizes, default=0)  # every file fits any bucket
        infos = on_engines(pool, clients, "server_info", lambda c: c.server_info(timeout_s=deadline.left()),
                           deadline)
        self._format = "sglang" if self.wire_format == "sglang" else agree_format(infos)
        tp = [int(info.get("tp_size", 1)) for info in infos]
        starts = [sum(tp[:k]) for k in range(len(tp))]  # engine k reads payloads [start, start + tp_k)
        self._ranks = {c.base_url: (start, start + n) for c, start, n in zip(clients, starts, tp)}

        def write(i: int) -> list[str]:
            """Bucket i's `serialized_named_tensors`: one shm descriptor for every engine, or
            one CUDA descriptor or SGLang payload per engine TP rank (each read once)."""
            names = [s["name"] for s in plan[i]]
            if self._format == "shm":
                return [backend.named_tensors_to_shm(names, i, buffer_bytes, timeout_s=deadline.left())]
            if self._format == "cuda":
                return backend.named_tensors_to_cuda(names, i, sum(tp), timeout_s=deadline.left())
            return backend.named_tensors_to_sglang(names, i, sum(tp), timeout_s=deadline.left())

        self._write = write
        stage = ThreadPoolExecutor(max_workers=4, thread_name_prefix="weight-sync-stage")
        self._stage: ThreadPoolExecutor | None = stage
        self._first: Future | None = stage.submit(write, 0) if plan else None

    def _send(self, pool: ThreadPoolExecutor, clients: list[EngineClient], backend: WeightSource,
              deadline: Deadline) -> int:
        flush = self.pause_mode != "in_place"
        num_buckets = len(self.plan(backend, deadline))
        stage, writing = self._stage, self._first
        assert stage is not None and (writing is not None or num_buckets == 0), "_prepare runs first"

        def post(payloads: list[str]) -> None:
            on_engines(pool, clients, "update_weights_from_tensor", lambda c: c.update_weights_from_tensor(
                payloads if self._format == "shm" else payloads[slice(*self._ranks[c.base_url])],
                "flattened_bucket", flush, timeout_s=deadline.left()), deadline)

        try:  # the writer and the posters run in `_stage`; `pool` serves the per-engine calls
            posts: list[Future] = []
            for i in range(num_buckets):
                assert writing is not None
                payloads = result(writing, deadline, f"trainer writing bucket {i}")
                if i + 1 < num_buckets:
                    writing = stage.submit(self._write, i + 1)
                posts.append(stage.submit(post, payloads))
            for i, p in enumerate(posts):
                result(p, deadline, f"engines taking bucket {i}")
        finally:
            self._stop_stage()
        return self._bytes

    def _on_failure(self, backend: WeightSource) -> None:
        self._stop_stage()

    def _stop_stage(self) -> None:
        stage = getattr(self, "_stage", None)
        if stage is not None:
            stage.shutdown(wait=False, cancel_futures=True)
            self._stage = None

    def close(self) -> None:
        if self.backend is not None:
            try:
                self.backend.release_weight_buffers(timeout_s=self.cleanup_timeout_s)
            except Exception as exc:  # noqa: BLE001 - the trainer may be gone already
                log.warning("releasing the trainer's weight buffers: %s", exc)


def agree_format(infos: list[dict[str, Any]]) -> str:
    """The format every engine reads, from their /server_info `tensor_formats`: milepost's
    shm descriptor (engines on CPU), milepost's CUDA descriptor (engines on a GPU), else
    SGLang's own (SGLang engines, or a fleet that agrees on neither)."""
    listed = [set(info.get("tensor_formats") or []) for info in infos]
    for name, fmt in (("shm", wire.SHM_FORMAT), ("cuda", cuda_buffers.CUDA_FORMAT)):
        if listed and all(fmt in formats for formats in listed):
            return name
    return "sglang"
