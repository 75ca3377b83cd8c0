"""The engine's side of the distributed transport: a process group with the trainer
(/init_weights_update_group) and buckets received by broadcast from rank 0
(/update_weights_from_distributed) into the receiver's private shadow tensors."""

from __future__ import annotations

import datetime
import time
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from milepost.core.weight_sync import groups, packing, wire

if TYPE_CHECKING:
    from milepost.core.engine.weight_receiver import WeightReceiver


class GroupReceiver:
    """Groups by name. A collective that failed (e.g. timed out) leaves the peers out of
    step, so its group is marked broken and refuses buckets until destroyed. Called only
    under the receiver's update lock (receive) or for group set-up, which touches only the
    dicts (atomic operations)."""

    def __init__(self, receiver: WeightReceiver) -> None:
        self.receiver = receiver
        self._groups: dict[str, tuple[Any, int, str]] = {}  # name → (group, streams, backend)
        self._broken: dict[str, str] = {}
        self._flat: torch.Tensor | None = None  # reused receive buffer of flattened buckets

    def init(self, address: str, port: int, rank: int, world_size: int, group_name: str,
             backend: str, streams: int = 1) -> tuple[int, str]:
        if group_name in self._groups:
            return 400, f"group {group_name} exists: destroy it first"
        pg = groups.init_weight_group(address, port, rank, world_size, group_name, self.receiver.group_timeout_s,
                                      backend, streams)
        self._groups[group_name] = (pg, streams, backend)
        return 200, f"joined {group_name} as rank {rank} of {world_size} ({streams} stream(s))"

    def destroy(self, group_name: str) -> tuple[int, str]:
        entry = self._groups.pop(group_name, None)
        self._broken.pop(group_name, None)
        if entry is None:
            return 400, f"no group {group_name}"
        groups.destroy_weight_group(entry[0])
        return 200, f"destroyed {group_name}"

    def receive(self, specs: list[wire.Spec], group_name: str, flattened: bool) -> str:
        """Receive one bucket and stage it. A bucket that does not fit the model is still
        received (into scratch) and then rejected, so the trainer's broadcast never waits
        for a receiver that gave up."""
        entry = self._groups.get(group_name)
        if entry is None or group_name in self._broken:
            raise ValueError(f"group {group_name} is {'broken' if entry else 'unknown'}: "
                             "/destroy_weights_update_group and init it again")
        pg, streams, backend = entry
        problem = self.receiver.problems(specs)
        via_host = backend == "gloo" and self._device().type != "cpu"  # gloo moves host memory only
        try:
            if flattened:
                self._receive_flat(specs, pg, streams, problem is None, via_host)
            else:
                self._receive_each(specs, pg, problem is None, via_host)
        except Exception as exc:
            self._broken[group_name] = str(exc)
            raise
        if problem:
            raise ValueError(problem)
        return f"staged {len(specs)} tensors from group {group_name}"

    def _receive_flat(self, specs: list[wire.Spec], pg: Any, streams: int, keep: bool, via_host: bool) -> None:
        """The bucket's bytes in groups.flat_pieces: straight into the live tensors where a
        memory resume left them unloaded (receiver.in_place_span), or into the shadows laid
        out back to back (receiver.shadow_span), else into a reused buffer, then copied to them.
        `via_host`: a gloo group and weights on a GPU: always the buffer, in host memory."""
        dtypes = {s["dtype"] for s in specs}
        if len(dtypes) != 1:  # the group is still in step: nothing was received
            raise ValueError(f"a flattened bucket holds one dtype, got {sorted(dtypes)}")
        in_place = self.receiver.in_place_span(specs) if keep and not via_host else None
        flat = in_place[0] if in_place else self.receiver.shadow_span(specs) if keep and not via_host else None
        offs, total = wire.offsets(specs)
        staged = flat is None  # then received into the reused buffer, copied to the shadows after
        if flat is None:
            device = torch.device("cpu") if via_host else self._device()
            if self._flat is None or self._flat.numel() < total or self._flat.device != device:
                self._flat = torch.empty(total, dtype=torch.uint8, device=device)
            flat = self._flat[:total].view(wire.parse_dtype(specs[0]["dtype"]))
        pieces = groups.flat_pieces(groups.as_sent(flat), streams)
        self._wait([dist.broadcast(p, src=0, group=pg, async_op=True) for p in pieces])
        if in_place:
            self.receiver.mark_in_place(in_place[1])
        if keep and staged:
            buffer = self._flat
            assert buffer is not None  # the staged branch above made it
            placed = [{**s, "offset": o} for s, o in zip(specs, offs)]
            packing.copy_bucket(self.receiver.staging_targets(specs), buffer, placed)

    def _receive_each(self, specs: list[wire.Spec], pg: Any, keep: bool, via_host: bool) -> None:
        """One broadcast per tensor, straight into its shadow when the dtypes match (and the
        group can write where it lives: `via_host` receives into host memory first)."""
        bufs, works = [], []
        for s in specs:
            dtype = wire.parse_dtype(s["dtype"])
            target = self.receiver.shadow(s["name"]) if keep else None
            if target is None or target.dtype != dtype or via_host:  # receive as sent, convert after
                target = torch.empty(s["shape"], dtype=dtype, device="cpu" if via_host else self._device())
            bufs.append(target)
            works.append(dist.broadcast(groups.as_sent(target), src=0, group=pg, async_op=True))
        self._wait(works)
        for s, b in zip(specs, bufs) if keep else ():
            shadow = self.receiver.shadow(s["name"])
            if b is not shadow:
                shadow.copy_(b)

    def _device(self) -> torch.device:
        """Where the weights live: nccl receives into CUDA memory, gloo into host memory."""
        return next(self.receiver.sched.model.parameters()).device

    def _wait(self, works: list[Any]) -> None:
        timeout_s = self.receiver.group_timeout_s
        deadline = time.monotonic() + timeout_s
        for w in works:
            left = max(0.001, deadline - time.monotonic())
            if not w.wait(timeout=datetime.timedelta(seconds=left)):
                raise TimeoutError(f"broadcast not received within {timeout_s} s")
