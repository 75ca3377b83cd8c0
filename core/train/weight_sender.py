"""The trainer's half of the tensor and distributed weight transports (rank 0 only).

`tensor`: copies a bucket of named tensors into a reused named /dev/shm file and returns
the descriptor the engine maps it by (milepost's extension for engines on CPU), or names
CUDA storages the engine maps once (cuda_buffers: milepost's extension for engines on a
GPU), or copies it into a reused shared buffer and returns SGLang's payload for it
(sglang_wire). `distributed`: joins a gloo group with the engines
(trainer = rank 0) and broadcasts buckets, flattened or tensor by tensor.
Formats: milepost.core.weight_sync.wire.
"""

from __future__ import annotations

import glob
import os
import random
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from milepost.core.quant import fp8
from milepost.core.train.cuda_sender import CudaSender
from milepost.core.weight_sync import groups, sglang_wire, wire
from milepost.core.weight_sync.packing import pack_parameters

__all__ = ["WeightSender", "pack_parameters", "source_names", "sweep_stale_buffers"]  # pack_parameters: packing

SHM_PREFIX = "milepost-w-"
MAX_FILES_PER_BUCKET = 4  # engines hold one set (served) and maybe one staged; more means a leak
SPLIT_BYTES = 4 << 20  # tensors this big are cut into one piece per copy thread


@dataclass
class BucketFile:
    name: str
    fd: int  # kept open: the exclusive flock is taken on it for each write
    buf: torch.Tensor


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def sweep_stale_buffers() -> None:
    """Remove buffers left by trainer processes that died without releasing them (the pid
    in the name is gone). Only this module's own naming pattern is touched."""
    for path in glob.glob(os.path.join(wire.SHM_DIR, f"{SHM_PREFIX}*-*")):
        pid = os.path.basename(path)[len(SHM_PREFIX):].split("-")[0]
        if pid.isdigit() and not _alive(int(pid)):
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass


def storage_groups(layout: list[tuple[str, torch.Tensor]]) -> list[list[tuple[str, torch.Tensor]]]:
    """`layout` split so that a bucket never mixes storages it need not: the tensors of each
    storage that holds several of them, in the order they lie in it, then the rest (a storage
    each, meta tensors computed at send time) in their own order; groups in order of first
    appearance. Why: a bucket whose tensors share one storage is read where it lies, with no
    copy (cuda_sender.packed_placement), and Megatron's staged views lie in its parameter
    buffer in megatron's order, q/k/v in a buffer of their own. Packed HF-order weights (the
    torch backend) come out in their own order."""
    def key(t: torch.Tensor) -> tuple[int, int] | None:
        return None if t.is_meta or not t.numel() else (t.device.index or 0, t.untyped_storage().data_ptr())

    counts: dict[tuple[int, int], int] = {}
    for _, t in layout:
        if (k := key(t)) is not None:
            counts[k] = counts.get(k, 0) + 1
    groups: dict[tuple[int, int] | None, list[tuple[str, torch.Tensor]]] = {}
    for name, t in layout:
        k = key(t)
        groups.setdefault(k if k is not None and counts[k] > 1 else None, []).append((name, t))
    return [sorted(g, key=lambda nt: nt[1].storage_offset() * nt[1].element_size()) if k is not None else g
            for k, g in groups.items()]


def source_names(names: list[str], weight_format: str | None) -> list[str]:
    """The trainer's tensors that the sent tensors `names` are computed from: an fp8
    `X.weight_scale_inv` comes from `X.weight` (a backend that stages tensors by name, as
    Megatron gathers them, stages these)."""
    if weight_format != "fp8":
        return list(names)
    return list(dict.fromkeys(n.removesuffix(fp8.SCALE_SUFFIX) for n in names))


class WeightSender:
    """Sends `module`'s weights. A tied weight travels once, under its first state-dict name.

    Files: bucket i is written to the first of `milepost-w-<pid>-<i>-<k>` (k = 0, 1, …)
    that no engine holds, i.e. on which an exclusive non-blocking flock succeeds (engines
    hold shared flocks on files whose tensors they stage or serve). So steady state
    alternates two sets of files: one served, one written. Files are created on first use
    and kept mapped (no page faults later); `release()` unlinks them. The copy into a file
    runs on `copy_threads` Python threads, each copying its own pieces with one torch
    thread: no lockstep between them, so a core busy elsewhere slows one piece instead of
    stalling every tensor (a 2-thread torch copy of many tensors did: 1.1 vs 10 GB/s).
    Concurrency: one caller at a time (a Ray actor runs its methods in order), so there
    are no locks here.
    """

    def __init__(self, module: torch.nn.Module, copy_threads: int | None = None,
                 weight_format: str | None = None) -> None:
        """`weight_format`: None sends the tensors as they are; "fp8" sends what
        precision.rollout fp8 serves (`sent_layout`)."""
        if weight_format not in (None, "fp8"):
            raise ValueError(f"weight_format {weight_format!r}: use None or fp8")
        self.module, self.weight_format = module, weight_format
        self.copy_threads = copy_threads or min(4, len(os.sched_getaffinity(0)))
        self._copy_pool: ThreadPoolExecutor | None = None
        self._files: dict[int, list[BucketFile]] = {}
        self._sglang_buffers: dict[int, torch.Tensor] = {}  # bucket → shared buffer (SGLang's format)
        self.cuda = CudaSender()  # milepost's CUDA format: buffers, exports and plans
        self._groups: dict[str, tuple[Any, int, str]] = {}  # name → (group, streams, backend)
        self._flat: torch.Tensor | None = None
        self._swept = False

    def named_tensors(self) -> list[tuple[str, torch.Tensor]]:
        seen, out = set(), []
        for name, t in self.module.state_dict().items():
            key = (t.data_ptr(), t.numel(), t.dtype)
            if t.numel() and key in seen:
                continue
            seen.add(key)
            out.append((name, t.detach()))
        return out

    def buckets(self, bucket_bytes: int) -> list[list[wire.Spec]]:
        """The push's buckets: the sent tensors in order, except that tensors sharing a storage
        go together, in the order they lie in it (storage_groups)."""
        return [b for group in storage_groups(self.sent_layout()) for b in wire.plan_buckets(group, bucket_bytes)]

    def sent_layout(self) -> list[tuple[str, torch.Tensor]]:
        """What a push sends, in order: (name, a tensor of its dtype and shape; a meta tensor
        for what is computed at send time). fp8: the block-wise format of core/quant/fp8.py
        for every tensor `served_in_fp8` picks (`X.weight` in float8_e4m3fn and its
        `X.weight_scale_inv`), grouped by dtype (the rest as they are, then the fp8 weights,
        then the scales) so the one-dtype buckets stay few and large."""
        named = self.named_tensors()
        if self.weight_format is None:
            return named
        picked = [(n, t) for n, t in named if fp8.served_in_fp8(n, t.shape)]
        return ([(n, t) for n, t in named if not fp8.served_in_fp8(n, t.shape)]
                + [(n, torch.empty(t.shape, dtype=fp8.FP8_DTYPE, device="meta")) for n, t in picked]
                + [(fp8.scale_name(n), torch.empty(fp8.scale_shape(*t.shape), device="meta")) for n, t in picked])

    def _gather(self, names: list[str]) -> list[tuple[wire.Spec, torch.Tensor]]:
        """The tensors of `names` as sent: fp8 weights quantised and scales computed now, from
        the live weights (a scale is computed apart from its weight: they travel in buckets
        of their own dtype, and one more read of a weight is cheaper than keeping state
        between buckets that a failed push could leave stale). The names come from the plan
        (`sent_layout`, which already left out tied duplicates), so they are looked up in the
        state dict as it is: `named_tensors()`' pass over every tensor, per bucket, was most of
        the trainer's Python time in a push (bench/results/weight_sender_python_cpu.txt)."""
        tensors = self.module.state_dict(keep_vars=True)  # detached below, only the bucket's
        out: list[tuple[wire.Spec, torch.Tensor]] = []
        with torch.no_grad():  # kept vars may require grad: fp8's quantisation must not record a graph
            for n in names:
                t = self._sent_tensor(n, tensors).detach()
                out.append(({"name": n, "dtype": wire.dtype_name(t.dtype), "shape": list(t.shape)}, t))
        return out

    def _sent_tensor(self, name: str, tensors: dict[str, torch.Tensor]) -> torch.Tensor:
        if self.weight_format == "fp8":
            source = name.removesuffix(fp8.SCALE_SUFFIX)
            if source in tensors and fp8.served_in_fp8(source, tensors[source].shape):
                if source != name:
                    return fp8.block_scale_inv(tensors[source])
                return fp8.quantize_fp8_blockwise(tensors[source])[0]
        if name not in tensors:
            raise KeyError(f"the trainer's model has no tensor {name!r}")
        return tensors[name]

    # ---- tensor transport ----
    def to_shm(self, names: list[str], bucket: int, buffer_bytes: int) -> str:
        """Copy `names` into a free file of bucket `bucket`; returns the base64 descriptor."""
        pairs = self._gather(names)
        specs = [s for s, _ in pairs]
        offs, total = wire.offsets(specs)
        f = self._free_file(bucket, wire.HEADER_BYTES + max(total, buffer_bytes))
        try:
            self._copy([(wire.view(f.buf, wire.HEADER_BYTES + o, spec), t) for (spec, t), o in zip(pairs, offs)])
            generation = random.getrandbits(62)
            wire.write_header(f.buf, generation, f.buf.numel())
        finally:
            wire.unlock(f.fd)
        return wire.encode_shm_descriptor(f.name, f.buf.numel(), generation, specs)

    def to_sglang(self, names: list[str], bucket: int, copies: int = 1) -> list[str]:
        """Copy `names` into bucket `bucket`'s shared buffer; returns `copies` payloads of
        SGLang's format for it (sglang_wire.encode), one per receiving TP rank: each payload
        holds one reference to the shared segment that its reader gives back, so one
        payload read twice would free the segment under the sender (measured: the second
        engine's next push found it gone). The buffer is reused by the next push: an engine
        copies a bucket before answering its /update_weights_from_tensor (SGLang loads it;
        the built-in engine copies it into its shadows). Weights on a GPU go in a buffer on
        that GPU, shared by CUDA IPC handle (SGLang's colocated format)."""
        pairs = self._gather(names)
        specs = [s for s, _ in pairs]
        offs, total = wire.offsets(specs)
        device = pairs[0][1].device if pairs else torch.device("cpu")  # CUDA: shared by IPC handle
        flat = self._sglang_buffers.get(bucket)
        if flat is None or flat.numel() < total or flat.device != device:
            flat = self._sglang_buffers[bucket] = sglang_wire.shared_buffer(total, device)
        self._fill(flat, pairs, offs)
        return [sglang_wire.encode(flat[:total], specs) for _ in range(copies)]

    def to_cuda(self, names: list[str], bucket: int, readers: int = 1) -> list[str]:
        """`names` as milepost's CUDA descriptors, one per receiving TP rank (core/train/cuda_sender.py:
        read in place where packed, else copied into bucket `bucket`'s reused CUDA buffer;
        synchronised before returning)."""
        live = self._live(names) if self.weight_format is None else None  # fp8: computed, planned each push
        return self.cuda.send(names, bucket, readers, live, self._gather)

    def _live(self, names: list[str]) -> list[torch.Tensor]:
        """The module's tensors of `names`, as they are (no detach: read, or copied under no_grad)."""
        tensors = self.module.state_dict(keep_vars=True)
        try:
            return [tensors[n] for n in names]
        except KeyError as exc:
            raise KeyError(f"the trainer's model has no tensor {exc.args[0]!r}") from None

    def _fill(self, flat: torch.Tensor, pairs: list[tuple[wire.Spec, torch.Tensor]], offs: list[int]) -> None:
        """A bucket's tensors into `flat` at `offs` (back to back from 0): on a GPU with every
        tensor there, one concatenation (wire.pack_into), else _copy."""
        if flat.is_cuda and all(t.device == flat.device for _, t in pairs):
            wire.pack_into(flat, [t for _, t in pairs])
            return
        self._copy([(wire.view(flat, o, spec), t) for (spec, t), o in zip(pairs, offs)])

    def _copy(self, pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """dst.copy_(src) for every pair: into a CUDA buffer as one multi-tensor copy (one
        launch, not one per tensor: the GPU's copy engine needs no threads), into host memory
        spread over the copy threads in balanced groups."""
        n = self.copy_threads
        if pairs and pairs[0][0].is_cuda:
            wire.copy_all([d for d, _ in pairs], [s for _, s in pairs])
            return
        if n == 1:
            for dst, src in pairs:
                dst.copy_(src)
            return
        pieces: list[tuple[torch.Tensor, torch.Tensor]] = []
        for dst, src in pairs:
            if src.numel() * src.element_size() >= SPLIT_BYTES:
                pieces += zip(dst.view(-1).chunk(n), src.reshape(-1).chunk(n))
            else:
                pieces.append((dst, src))
        groups: list[list[tuple[torch.Tensor, torch.Tensor]]] = [[] for _ in range(n)]
        loads = [0] * n
        for dst, src in sorted(pieces, key=lambda p: -p[1].numel()):
            i = loads.index(min(loads))
            groups[i].append((dst, src))
            loads[i] += src.numel() * src.element_size()
        if self._copy_pool is None:
            self._copy_pool = ThreadPoolExecutor(max_workers=n, thread_name_prefix="weight-copy")
        for _ in self._copy_pool.map(lambda g: [d.copy_(s) for d, s in g], groups):
            pass

    def _free_file(self, bucket: int, nbytes: int) -> BucketFile:
        """A file of bucket `bucket` that no engine holds, locked exclusively, >= nbytes."""
        if not self._swept:
            sweep_stale_buffers()
            self._swept = True
        files = self._files.setdefault(bucket, [])
        for f in list(files):
            if wire.try_lock(f.fd, exclusive=True):
                if f.buf.numel() >= nbytes:
                    return f
                files.remove(f)  # too small: replace it (readers keep the old inode)
                os.close(f.fd)
                files.append(self._create(f.name, nbytes))
                return files[-1]
        if len(files) >= MAX_FILES_PER_BUCKET:
            raise RuntimeError(f"engines still hold all {len(files)} shared-memory files of bucket {bucket}; "
                               "an engine is stuck in a weight-update session or leaks leases")
        used = {f.name for f in files}
        name = next(n for k in range(MAX_FILES_PER_BUCKET + 1)
                    if (n := f"{SHM_PREFIX}{os.getpid()}-{bucket}-{k}") not in used)
        files.append(self._create(name, nbytes))
        return files[-1]

    @staticmethod
    def _create(name: str, nbytes: int) -> BucketFile:
        st = os.statvfs(wire.SHM_DIR)
        if st.f_bavail * st.f_frsize < nbytes:  # writing past a full tmpfs is a SIGBUS, not an error
            raise RuntimeError(f"{wire.SHM_DIR} has {st.f_bavail * st.f_frsize / 2**20:.0f} MiB free; the tensor "
                               f"transport needs {nbytes / 2**20:.0f} MiB more: enlarge {wire.SHM_DIR} (e.g. "
                               "docker --shm-size) or use sync.transport distributed or disk")
        fd = wire.create_shm(name, nbytes)
        if not wire.try_lock(fd, exclusive=True):  # new inode: nobody else can hold it
            raise AssertionError(f"fresh file {name} is locked")
        return BucketFile(name, fd, wire.map_fd(fd))

    def release(self) -> None:
        """Unlink every file (engines keep the memory they map until they swap it out) and
        drop the shared buffers of SGLang's format."""
        self._sglang_buffers.clear()
        self.cuda.release()
        for files in self._files.values():
            for f in files:
                os.close(f.fd)
                try:
                    os.unlink(wire.shm_path(f.name))
                except FileNotFoundError:
                    pass
        self._files.clear()

    # ---- distributed transport ----
    def init_group(self, master_address: str, master_port: int, world_size: int, group_name: str,
                   timeout_s: float, backend: str = "gloo", streams: int = 1) -> None:
        if group_name in self._groups:
            raise ValueError(f"weight-update group {group_name} exists; destroy it first")
        pg = groups.init_weight_group(master_address, master_port, 0, world_size, group_name, timeout_s, backend,
                                      streams)
        self._groups[group_name] = (pg, streams, backend)

    def broadcast(self, names: list[str], group_name: str, flattened: bool) -> None:
        """Broadcast one bucket from rank 0; returns when every engine has it (or the
        group's timeout raises). Flattened: the bucket's bytes in groups.flat_pieces, sent
        straight from the weights when they lie back to back (pack_parameters), else from a
        reused staging buffer."""
        pg, streams, backend = self._groups[group_name]
        pairs = self._gather(names)
        host = backend == "gloo"  # gloo moves host memory only: weights on a GPU go through it
        if flattened:
            tensors = groups.flat_pieces(groups.as_sent(self._flat_bucket(pairs, host)), streams)
        else:
            tensors = [groups.as_sent(t.contiguous().cpu() if host else t.contiguous()) for _, t in pairs]
        for w in [dist.broadcast(t, src=0, group=pg, async_op=True) for t in tensors]:
            w.wait()

    def _flat_bucket(self, pairs: list[tuple[wire.Spec, torch.Tensor]], host: bool) -> torch.Tensor:
        """The bucket's bytes as one tensor: the weights themselves where they lie back to back,
        else a reused staging buffer; in host memory when `host` (a gloo group)."""
        specs = [s for s, _ in pairs]
        if len({s["dtype"] for s in specs}) != 1:
            raise ValueError("a flattened bucket must hold one dtype (plan it with buckets())")
        flat = wire.span([t for _, t in pairs])
        if flat is not None:
            return flat.cpu() if host else flat
        offs, total = wire.offsets(specs)
        device = torch.device("cpu") if host or not pairs else pairs[0][1].device
        if self._flat is None or self._flat.numel() < total or self._flat.device != device:
            self._flat = torch.empty(total, dtype=torch.uint8, device=device)
        wire.copy_all([wire.view(self._flat, o, spec) for (spec, _), o in zip(pairs, offs)], [t for _, t in pairs])
        return self._flat[:total].view(wire.parse_dtype(specs[0]["dtype"]))

    def destroy_group(self, group_name: str) -> None:
        entry = self._groups.pop(group_name, None)
        if entry is not None:
            groups.destroy_weight_group(entry[0])
