"""The weight-update process group, shared by the trainer (rank 0) and the engines.

SGLang's pattern (init_weight_group says exactly which): a rendezvous on the trainer's
address, then a process group beside any default group the process has, through torch's own
helper, whatever the backend (nccl on GPUs, gloo on CPU; choose_backend).

Milepost's extension: gloo may run `streams` TCP connections instead of one. Why: on
loopback a single gloo connection is bound by the sender's core (it copies into the socket
and runs the TCP receive path for its peer too: measured 100 % system time on the sender, 60 % on the
receiver). With several connections both cores carry both halves. torch's gloo group
already supports this (one connection per device, collective k on device k % n), but only
through GLOO_SOCKET_IFNAME, which is global to the process; here the devices are built
per group. Both sides must use the same count, or the group never forms: the transport
agrees on it with every engine first (distributed.agree_streams).

Over several streams a flattened bucket (load_format flattened_bucket: the tensors' bytes
back to back) travels as `flat_pieces`, one broadcast per stream; with one stream it is
SGLang's single broadcast. Both sides cut it the same way, so the cut is part of the
`gloo_streams` extension.
"""

from __future__ import annotations

import datetime
import os
from typing import TYPE_CHECKING, Any, cast

import torch

from milepost.core.tcp_store import bound_store
from milepost.core.weight_sync.wire import Spec, spec_nbytes

if TYPE_CHECKING:  # GroupName: a NewType of str in torch's own annotations (not in every torch>=2.6)
    from torch.distributed import ProcessGroup, Store
    from torch.distributed.distributed_c10d import GroupName

MAX_GLOO_STREAMS = 16
GROUP_BACKENDS = ("nccl", "gloo")


def check_streams(streams: int) -> None:
    """ValueError unless `streams` is a connection count a group may have."""
    if not 1 <= streams <= MAX_GLOO_STREAMS:
        raise ValueError(f"gloo_streams={streams}: use 1 to {MAX_GLOO_STREAMS}")


def init_weight_group(master_address: str, master_port: int, rank: int, world_size: int, group_name: str,
                      timeout_s: float, backend: str = "gloo", streams: int = 1) -> ProcessGroup:
    """Join the group `group_name` as `rank`; rank 0 hosts the TCP store. Returns the
    process group (for torch.distributed calls with group=...).

    Formed exactly as SGLang forms it (`init_custom_process_group`, sglang 0.5.23
    srt/utils/common.py:2859): rendezvous(tcp://address:port) → store.set_timeout →
    PrefixStore(group_name, store) → torch's `_new_process_group_helper(world_size, rank, [],
    Backend(backend), store, group_name=…, backend_options=None, timeout=…)` →
    `_world.pg_group_ranks`. The helper adds its own key levels (per device): a group built
    any other way waits on keys that never appear. One difference, on rank 0 only: its store
    is `tcp_store.bound_store`, listening on `master_address` only (torch's tcp:// rendezvous
    listens on every interface); the keys are the same. `streams` > 1 (gloo only) is
    milepost's extension (`_gloo_group`), formed only with engines that announced it."""
    from torch.distributed.distributed_c10d import Backend, PrefixStore, _new_process_group_helper, _world, rendezvous
    check_streams(streams)
    if streams > 1 and backend != "gloo":
        raise ValueError(f"streams={streams}: more than 1 only with gloo ({backend} has its own channels)")
    if backend not in GROUP_BACKENDS:
        raise ValueError(f"weight-update group backend `{backend}`: use nccl (GPUs) or gloo (CPU)")
    timeout = datetime.timedelta(seconds=timeout_s)
    if rank == 0:
        store = bound_store(master_address, master_port, world_size, True, timeout)
    else:  # the engines' side: SGLang's rendezvous
        host = f"[{master_address}]" if ":" in master_address else master_address
        store, rank, world_size = next(rendezvous(f"tcp://{host}:{master_port}", rank, world_size,
                                                  timeout=timeout))
    store.set_timeout(timeout)
    prefixed = PrefixStore(group_name, store)
    if streams > 1:
        pg = _gloo_group(prefixed, rank, world_size, group_name, timeout, streams)
    else:
        pg, _ = _new_process_group_helper(world_size, rank, [], Backend(backend), prefixed,
                                          group_name=cast("GroupName", group_name), backend_options=None,
                                          timeout=timeout)
    _world.pg_group_ranks[pg] = {i: i for i in range(world_size)}
    return pg


def rank_offsets(tp_sizes: list[int]) -> tuple[list[int], int]:
    """Each engine's first rank in the group and the group's size, as SGLang expects:
    trainer rank 0, engine i's TP rank r joins as `1 + Σ_{j<i} tp_j + r`, world 1 + Σ tp."""
    if any(not isinstance(t, int) or isinstance(t, bool) or t < 1 for t in tp_sizes):
        raise ValueError(f"engine TP sizes {tp_sizes}: each must be an int >= 1 (/server_info `tp_size`)")
    offsets, pos = [], 1
    for tp in tp_sizes:
        offsets.append(pos)
        pos += tp
    return offsets, pos


def choose_backend(server_infos: list[dict[str, Any]]) -> str:
    """nccl unless every engine says it runs on the CPU (/server_info `device`: "cpu", as the
    built-in engine does): SGLang serves from GPUs and receives weights over nccl."""
    cpu = all(str(info.get("device", "cuda")).lower() == "cpu" for info in server_infos)
    return "gloo" if cpu else "nccl"


def _gloo_group(store: Store, rank: int, world_size: int, group_name: str, timeout: datetime.timedelta,
                streams: int) -> ProcessGroup:
    """A gloo group with `streams` connections per peer, on the devices torch would pick
    (GLOO_SOCKET_IFNAME's interfaces, else the host's default), each repeated."""
    from torch._C._distributed_c10d import ProcessGroup, ProcessGroupGloo
    from torch.distributed.distributed_c10d import PrefixStore
    interfaces = [i for i in os.environ.get("GLOO_SOCKET_IFNAME", "").split(",") if i]
    opts = ProcessGroupGloo._Options()  # type: ignore[attr-defined]  # private, not in torch's stubs
    opts._timeout = timeout
    opts._devices = [ProcessGroupGloo.create_device(interface=i) if i else ProcessGroupGloo.create_default_device()
                     for _ in range(streams) for i in (interfaces or [""])]
    opts._threads = 2 * len(opts._devices)  # torch's default: two workers per device
    gloo_store = PrefixStore(f"{group_name}/", store)
    gloo = ProcessGroupGloo(gloo_store, rank, world_size, opts)
    pg = ProcessGroup(gloo_store, rank, world_size)
    pg._set_default_backend(ProcessGroup.BackendType.GLOO)
    pg._register_backend(torch.device("cpu"), ProcessGroup.BackendType.GLOO, gloo)
    pg._set_group_name(cast("GroupName", group_name))
    return pg


def destroy_weight_group(pg: ProcessGroup) -> None:
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import _world
    if pg in _world.pg_map:  # made by torch's helper (nccl)
        dist.destroy_process_group(pg)
        return
    _world.pg_group_ranks.pop(pg, None)
    pg.shutdown()


BYTE_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)  # gloo has no such type ("Invalid scalar type")


def as_sent(t: torch.Tensor) -> torch.Tensor:
    """What a broadcast carries for `t`: its bytes (a uint8 view) when gloo has no such
    dtype (float8), else `t` itself. Both sides view alike; NCCL sends float8 as bytes too,
    so a receiver that broadcasts into a float8 tensor (SGLang) gets the same bytes."""
    return t.view(torch.uint8) if t.dtype in BYTE_DTYPES else t


def flat_pieces(flat: torch.Tensor, streams: int) -> list[torch.Tensor]:
    """The broadcasts of a flattened bucket `flat` (1-D) over a group of `streams`
    connections: equal runs of elements in order, one per connection (broadcast k goes over
    connection k), no empty ones. Fewer, larger broadcasts: each gloo broadcast costs a
    round trip before its bytes flow (measured: 75 pieces 10 % slower than 16)."""
    if streams <= 1:
        return [flat]
    return [p for p in flat.tensor_split(streams) if p.numel()]


def interleave(specs: list[Spec], streams: int) -> list[Spec]:
    """Reorder one bucket so that, sent one broadcast per tensor, every stream carries about
    the same bytes: broadcast k goes over stream k % streams (whatever stream comes first),
    so each position takes the largest tensor left while its stream is the least loaded,
    else the smallest. One stream: the order is kept."""
    if streams <= 1:
        return list(specs)
    rest = sorted(specs, key=spec_nbytes, reverse=True)
    load = [0] * streams
    out: list[Spec] = []
    while rest:
        k = len(out) % streams
        spec = rest.pop(0) if load[k] <= min(load) else rest.pop()
        load[k] += spec_nbytes(spec)
        out.append(spec)
    return out

