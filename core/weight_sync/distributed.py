"""`distributed` transport (disaggregated): trainer rank 0 and every engine form one
process group (/init_weights_update_group); each bucket is one
/update_weights_from_distributed per engine while the trainer broadcasts it from src 0."""

from __future__ import annotations

import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from milepost.core.fleet.client import EngineClient
from milepost.core.weight_sync import groups, wire
from milepost.core.weight_sync.base import Deadline, WeightSource, best_effort, log, on_engines, result
from milepost.core.weight_sync.session import SessionTransport


class DistributedTransport(SessionTransport):
    """Rules: the group is made once per set of engines and reused across pushes. Ranks as
    SGLang expects them: trainer 0, engine i's TP ranks from `1 + Σ_{j<i} tp_j` (running
    offsets, groups.rank_offsets; tp from each engine's /server_info `tp_size`), world
    `1 + Σ tp`. After any failed attempt the group is destroyed on all sides and made again
    under a new name, because a collective that failed leaves its peers out of step.
    Buckets go one at a time, each in the same order on both sides. The trainer's side of
    the group times out after `timeout_s`, so a broadcast to a dead engine ends.
    `group_backend`: None (the default) picks it from the engines' /server_info
    (groups.choose_backend: gloo when every engine runs on the CPU, else nccl).
    `gloo_streams`: TCP connections of a gloo group (groups.py says why more than one); the
    group gets the count every engine accepts (agree_streams). `flattened`: buckets travel as their bytes back to back
    (load_format flattened_bucket; one broadcast per connection, groups.flat_pieces) rather
    than one broadcast per tensor (reordered so each connection carries about the same
    bytes). None (the default) picks flattened exactly when the group has several
    connections, i.e. the engines are milepost's: they and a packed trainer
    (pack_parameters) send and receive those bytes in place, and few large broadcasts beat
    one per tensor (bench/weight_sync.py). With one connection (SGLang) each tensor is its
    own broadcast: SGLang's default load_format, and no copy on the trainer.
    """

    name = "distributed"

    def __init__(self, timeout_s: float = 120.0, bucket_mb: float = 512.0, num_attempts: int = 2,
                 pause_mode: str = "abort", cleanup_timeout_s: float = 5.0, flattened: bool | None = None,
                 group_backend: str | None = None, gloo_streams: int = 1) -> None:
        super().__init__(timeout_s, bucket_mb, num_attempts, pause_mode, cleanup_timeout_s)
        groups.check_streams(gloo_streams)
        self.flattened, self.group_backend, self.gloo_streams = flattened, group_backend, gloo_streams
        self._group: tuple[str, tuple[str, ...]] | None = None  # (name, engine urls)
        self._streams = 1  # of the current group
        self._clients: list[EngineClient] = []

    def _prepare(self, pool: ThreadPoolExecutor, clients: list[EngineClient], backend: WeightSource,
                 deadline: Deadline) -> None:
        urls = tuple(c.base_url for c in clients)
        if self._group is not None and self._group[1] == urls:
            return
        if self._group is not None:
            self._destroy(pool, self._clients, backend)
        infos = on_engines(pool, clients, "server_info", lambda c: c.server_info(timeout_s=deadline.left()),
                           deadline)
        offsets, world = groups.rank_offsets([info.get("tp_size", 1) for info in infos])
        group_backend = self.group_backend or groups.choose_backend(infos)
        streams = agree_streams(self.gloo_streams, infos) if group_backend == "gloo" else 1
        name = f"milepost_wu_{uuid.uuid4().hex[:8]}"
        address, port = backend.weight_group_address(timeout_s=deadline.left())
        self._group, self._clients = (name, urls), list(clients)  # set first: a failure destroys it
        self._streams = streams
        # the group's timeout (every later broadcast too) is a whole attempt's
        trainer = pool.submit(lambda: backend.init_weight_group(address, port, world, name, timeout_s=self.timeout_s,
                                                                backend=group_backend, streams=streams))
        on_engines(pool, clients, "init_weights_update_group", lambda c: c.init_weights_update_group(
            address, port, offsets[clients.index(c)], world, name, group_backend, timeout_s=deadline.left(),
            gloo_streams=streams), deadline)
        result(trainer, deadline, "trainer joining the weight-update group")

    def _send(self, pool: ThreadPoolExecutor, clients: list[EngineClient], backend: WeightSource,
              deadline: Deadline) -> int:
        assert self._group is not None
        group = self._group[0]
        flattened = self._streams > 1 if self.flattened is None else self.flattened
        fmt = "flattened_bucket" if flattened else None
        flush = self.pause_mode != "in_place"

        def send(i: int, bucket: list[wire.Spec]) -> int:
            """Bucket i: the trainer broadcasts while every engine receives; its bytes."""
            if not flattened:  # a flattened bucket keeps its order: it is one span of bytes
                bucket = groups.interleave(bucket, self._streams)
            names = [s["name"] for s in bucket]
            dtypes, shapes = [s["dtype"] for s in bucket], [s["shape"] for s in bucket]
            sender = pool.submit(lambda: backend.broadcast_weights(names, group, flattened,
                                                                   timeout_s=deadline.left()))
            on_engines(pool, clients, "update_weights_from_distributed", lambda c: c.update_weights_from_distributed(
                names, dtypes, shapes, group, fmt, flush, timeout_s=deadline.left()), deadline)
            result(sender, deadline, f"trainer broadcasting bucket {i}")
            return wire.offsets(bucket)[1]

        return sum(send(i, bucket) for i, bucket in enumerate(self.plan(backend, deadline)))

    def _engine_failure_cleanup(self, client: EngineClient, deadline: Deadline) -> None:
        if self._group is not None:
            client.destroy_weights_update_group(self._group[0], timeout_s=deadline.left())

    def _on_failure(self, backend: WeightSource) -> None:
        if self._group is not None:
            self._destroy_on_trainer(backend)

    def _destroy_on_trainer(self, backend: WeightSource) -> None:
        """Forget the group and destroy the trainer's side. The call may wait behind a
        broadcast that is still timing out: it is bounded, and the next group has a new name."""
        assert self._group is not None
        name, self._group = self._group[0], None
        try:
            backend.destroy_weight_group(name, timeout_s=self.cleanup_timeout_s)
        except Exception as exc:  # noqa: BLE001 - logged; nothing reuses the name
            log.warning("destroying weight-update group %s on the trainer: %s", name, exc)

    def _destroy(self, pool: ThreadPoolExecutor, clients: list[EngineClient], backend: WeightSource) -> None:
        assert self._group is not None
        name = self._group[0]
        best_effort(pool, clients, self.cleanup_timeout_s,
                    lambda c, d: c.destroy_weights_update_group(name, timeout_s=d.left()))
        self._destroy_on_trainer(backend)

    def close(self) -> None:
        if self._group is not None and self.backend is not None:
            with ThreadPoolExecutor(max_workers=len(self._clients) + 1) as pool:
                self._destroy(pool, self._clients, self.backend)


def agree_streams(wanted: int, server_infos: list[dict[str, Any]]) -> int:
    """The gloo connections a group can have: `wanted`, capped by what every engine's
    /server_info says it takes (`max_gloo_streams`; an engine that does not name it, e.g.
    SGLang, takes the one connection of the protocol)."""
    return max(1, min([wanted] + [int(info.get("max_gloo_streams", 1)) for info in server_infos]))
