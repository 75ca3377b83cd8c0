"""The WeightSource protocol of core/weight_sync, implemented once for every backend.

Rank 0 of a trainer sends weights (core/train/weight_sender.py). `SenderRank` gives a rank
actor the methods the transports call; `Rank0WeightSource` gives the driver-side backend the
same methods, forwarded to rank 0 with a timeout so a transport can bound every step.
`InProcessWeightSource` is both halves in one process (a trainer without Ray: benchmarks and
GPU tests on a machine that has no Ray).
"""

from __future__ import annotations

from typing import Any


class SenderRank:
    """Rank-side methods. The class defines `_weight_sender()` (a WeightSender over the
    tensors rank 0 sends) and `free_port()`."""

    def _weight_sender(self) -> Any:
        raise NotImplementedError

    def free_port(self) -> int:
        raise NotImplementedError

    def weight_buckets(self, bucket_bytes: int) -> list[list[dict[str, Any]]]:
        return self._weight_sender().buckets(bucket_bytes)

    def named_tensors_to_shm(self, names: list[str], bucket: int, buffer_bytes: int) -> str:
        return self._weight_sender().to_shm(names, bucket, buffer_bytes)

    def named_tensors_to_sglang(self, names: list[str], bucket: int, copies: int = 1) -> list[str]:
        return self._weight_sender().to_sglang(names, bucket, copies)

    def named_tensors_to_cuda(self, names: list[str], bucket: int, readers: int = 1) -> list[str]:
        return self._weight_sender().to_cuda(names, bucket, readers)

    def release_weight_buffers(self) -> None:
        self._weight_sender().release()

    def weight_group_address(self) -> tuple[str, int]:
        """The node's address and a port free on that very address: a port free on loopback
        may be taken on the node's address (measured: Ray's agents serve HTTP there, and an
        engine joining the group then pinged an HTTP server)."""
        import ray  # rank workers also run without Ray (bench/megatron_mfu.py on a bare GPU machine)

        from milepost.core.fleet.router import free_port
        address = ray.util.get_node_ip_address()
        return address, free_port(address)

    def init_weight_group(self, master_address: str, master_port: int, world_size: int, group_name: str,
                          timeout_s: float, backend: str = "gloo", streams: int = 1) -> None:
        self._weight_sender().init_group(master_address, master_port, world_size, group_name, timeout_s,
                                         backend, streams)

    def broadcast_weights(self, names: list[str], group_name: str, flattened: bool) -> None:
        self._weight_sender().broadcast(names, group_name, flattened)

    def destroy_weight_group(self, group_name: str) -> None:
        self._weight_sender().destroy_group(group_name)


class RankActors:
    """The driver side of a backend whose ranks are Ray actors, `self.actors` (rank 0 first)."""

    actors: list[Any]

    def _on_rank0(self, method: str, *args: Any, timeout_s: float) -> Any:
        import ray
        return ray.get(getattr(self.actors[0], method).remote(*args), timeout=timeout_s)

    def shutdown(self) -> None:
        import ray
        try:
            ray.get([a.shutdown.remote() for a in self.actors], timeout=60)
        except Exception:  # noqa: BLE001 - an actor that is already gone has no group to destroy
            pass
        for a in self.actors:
            ray.kill(a)
        self.actors = []


class Rank0WeightSource(RankActors):
    """Driver-side WeightSource methods. `_stage(names, timeout_s)` runs before anything that
    reads weights: a backend whose rank 0 does not hold whole tensors (Megatron: TP shards)
    gathers them there first; `names` None means every tensor."""

    def _stage(self, names: list[str] | None, timeout_s: float) -> None:
        """Rank 0 holds whole tensors already."""

    def weight_buckets(self, bucket_mb: float, timeout_s: float = 60.0) -> list[list[dict[str, Any]]]:
        self._stage(None, timeout_s)
        return self._on_rank0("weight_buckets", int(bucket_mb * 2**20), timeout_s=timeout_s)

    def named_tensors_to_shm(self, names: list[str], bucket: int, buffer_bytes: int, timeout_s: float = 60.0) -> str:
        """Write bucket `bucket` (these names) into a shared-memory file no engine holds."""
        self._stage(names, timeout_s)
        return self._on_rank0("named_tensors_to_shm", names, bucket, buffer_bytes, timeout_s=timeout_s)

    def named_tensors_to_sglang(self, names: list[str], bucket: int, copies: int = 1,
                                timeout_s: float = 60.0) -> list[str]:
        """Write bucket `bucket` into its shared buffer; `copies` SGLang flattened-bucket
        payloads of it, one per receiving TP rank (each is read once)."""
        self._stage(names, timeout_s)
        return self._on_rank0("named_tensors_to_sglang", names, bucket, copies, timeout_s=timeout_s)

    def named_tensors_to_cuda(self, names: list[str], bucket: int, readers: int = 1,
                              timeout_s: float = 60.0) -> list[str]:
        """Bucket `bucket` as milepost's CUDA descriptors, one per receiving TP rank."""
        self._stage(names, timeout_s)
        return self._on_rank0("named_tensors_to_cuda", names, bucket, readers, timeout_s=timeout_s)

    def release_weight_buffers(self, timeout_s: float = 60.0) -> None:
        self._on_rank0("release_weight_buffers", timeout_s=timeout_s)

    def weight_group_address(self, timeout_s: float = 60.0) -> tuple[str, int]:
        return self._on_rank0("weight_group_address", timeout_s=timeout_s)

    def init_weight_group(self, master_address: str, master_port: int, world_size: int, group_name: str,
                          timeout_s: float = 60.0, backend: str = "gloo", streams: int = 1) -> None:
        self._on_rank0("init_weight_group", master_address, master_port, world_size, group_name, timeout_s,
                       backend, streams, timeout_s=timeout_s)

    def broadcast_weights(self, names: list[str], group_name: str, flattened: bool, timeout_s: float = 60.0) -> None:
        self._stage(names, timeout_s)
        self._on_rank0("broadcast_weights", names, group_name, flattened, timeout_s=timeout_s)

    def destroy_weight_group(self, group_name: str, timeout_s: float = 60.0) -> None:
        self._on_rank0("destroy_weight_group", group_name, timeout_s=timeout_s)


class _ModuleRank(SenderRank):
    def __init__(self, module: Any, weight_format: str | None) -> None:
        from milepost.core.train.weight_sender import WeightSender
        self._sender = WeightSender(module, weight_format=weight_format)

    def _weight_sender(self) -> Any:
        return self._sender

    def free_port(self) -> int:
        from milepost.core.fleet.router import free_port
        return free_port("127.0.0.1")

    def weight_group_address(self) -> tuple[str, int]:
        """Loopback: an in-process trainer's engines run on this machine."""
        return "127.0.0.1", self.free_port()


class InProcessWeightSource(Rank0WeightSource):
    """A WeightSource over a module in this process (rank 0 is this process; no Ray): the
    transports' real trainer-side code, called directly. `timeout_s` is not enforced."""

    def __init__(self, module: Any, weight_format: str | None = None) -> None:
        self.rank = _ModuleRank(module, weight_format)

    def _on_rank0(self, method: str, *args: Any, timeout_s: float) -> Any:
        return getattr(self.rank, method)(*args)
