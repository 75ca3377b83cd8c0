"""What travels between trainer and engine in the tensor and distributed transports.

Shared by both sides (the engine imports only this module and groups.py of the package):
dtype names, bucket plans, the shared-memory descriptor sent as `serialized_named_tensors`
and named /dev/shm buffers. The weight-update process group is in groups.py.

A bucket plan is a list of buckets; a bucket is a list of specs {"name", "dtype", "shape"}
in the order the bytes travel. As in SGLang's FlattenedTensorBucket, a bucket holds one
dtype and its flat form is the tensors' elements back to back; a tensor larger than the
bucket size gets a bucket of its own.

Shared-memory buckets (tensor transport): the trainer writes a bucket into a named
/dev/shm file (header, then the tensors) and sends a descriptor (JSON, then base64; one per
TP rank in the request's list):
    {"format": "milepost-shm-v1", "shm_name": str, "nbytes": int, "generation": int,
     "tensors": [{"name", "dtype", "shape", "offset"}]}     offset: bytes from the file start
The engine maps the file and serves the tensors in place (no copy). Ownership is a file
lock: an engine holds a shared flock on every file whose tensors it has staged or serves;
the trainer rewrites a file only under an exclusive non-blocking flock, so never one an
engine uses. The header's generation (random per write) must equal the descriptor's, so a
late request never takes a file rewritten since. Header: int64 magic, generation, nbytes.
The engine serves the tensors in place, with no copy (SGLang's format costs a copy into
the engine's own tensors: the sender reuses its buffer).

Allow-list of this format (what the engine reads from a descriptor, and nothing else):
base64 of a JSON object in `serialized_named_tensors`, with format SHM_FORMAT, ints for
sizes and offsets, dtypes named in DTYPES, shm names matching _SHM_NAME inside SHM_DIR (no
"." or ".."). This format is milepost's extension, sent only to engines whose /server_info
lists it in `tensor_formats`; every other engine gets SGLang's own format (a pickled
flattened bucket, sglang_wire.py), which the built-in engine reads through an allow-list
unpickler only.
"""

from __future__ import annotations

import base64
import fcntl
import json
import math
import mmap
import os
import re
from typing import Any

import torch

SHM_FORMAT = "milepost-shm-v1"
HEADER_BYTES = 64  # keeps every tensor 64-byte aligned
MAGIC = 0x6D696C65706F7374  # "milepost"
SHM_DIR = "/dev/shm"
_SHM_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,200}$")
DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
    "float64": torch.float64, "int64": torch.int64, "int32": torch.int32, "int8": torch.int8,
    "uint8": torch.uint8, "bool": torch.bool,
    "float8_e4m3fn": torch.float8_e4m3fn,  # precision.rollout fp8 (core/quant/fp8.py)
}

Spec = dict[str, Any]  # {"name": str, "dtype": str, "shape": list[int]}


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def parse_dtype(name: Any) -> torch.dtype:
    if name not in DTYPES:
        raise ValueError(f"unknown dtype {name!r}; expected one of {', '.join(DTYPES)}")
    return DTYPES[name]


def spec_nbytes(spec: Spec) -> int:
    return math.prod(spec["shape"]) * parse_dtype(spec["dtype"]).itemsize


def plan_buckets(named: list[tuple[str, torch.Tensor]], bucket_bytes: int) -> list[list[Spec]]:
    """Group tensors, in order, into one-dtype buckets of at most `bucket_bytes` (a bigger
    tensor alone)."""
    buckets: list[list[Spec]] = []
    size, dtype = bucket_bytes + 1, None  # forces a new bucket for the first tensor
    for name, t in named:
        n = t.numel() * t.element_size()
        if size + n > bucket_bytes or t.dtype != dtype:
            buckets.append([])
            size, dtype = 0, t.dtype
        buckets[-1].append({"name": name, "dtype": dtype_name(t.dtype), "shape": list(t.shape)})
        size += n
    return buckets


def offsets(specs: list[Spec]) -> tuple[list[int], int]:
    """Byte offsets of each spec in a flat bucket (back to back), and the bucket's size."""
    out, pos = [], 0
    for s in specs:
        out.append(pos)
        pos += spec_nbytes(s)
    return out, pos


def encode_shm_descriptor(shm_name: str, nbytes: int, generation: int, specs: list[Spec]) -> str:
    """Descriptor of `specs` stored back to back after the header of file `shm_name`."""
    offs, _ = offsets(specs)
    body = {"format": SHM_FORMAT, "shm_name": shm_name, "nbytes": nbytes, "generation": generation,
            "tensors": [{**s, "offset": HEADER_BYTES + o} for s, o in zip(specs, offs)]}
    return base64.b64encode(json.dumps(body).encode()).decode()


PICKLE_PROTO = 0x80  # first byte of a pickle of protocol 2 or later (SGLang's payloads)


def decode_shm_descriptor(blob: Any) -> dict[str, Any]:
    """Parse and check a descriptor (the allow-list in the module docstring); ValueError
    names what is wrong."""
    try:
        raw = base64.b64decode(blob, validate=True)
    except Exception as exc:  # noqa: BLE001 - any garbage is the caller's error
        raise ValueError(f"serialized_named_tensors is not base64 ({SHM_FORMAT} descriptor): {exc}") from None
    if raw[:1] == bytes([PICKLE_PROTO]):
        raise ValueError("serialized_named_tensors holds a pickle (SGLang's format): read it with "
                         f"sglang_wire.decode (allow-list only), not as a {SHM_FORMAT} descriptor")
    try:
        body = json.loads(raw)
    except Exception as exc:  # noqa: BLE001 - any garbage is the caller's error
        raise ValueError(f"serialized_named_tensors is not base64 JSON ({SHM_FORMAT}): {exc}") from None
    if not isinstance(body, dict) or body.get("format") != SHM_FORMAT:
        raise ValueError(f"serialized_named_tensors must be a {SHM_FORMAT} descriptor on CPU")
    shm_path(body.get("shm_name"))
    nbytes, generation = body.get("nbytes"), body.get("generation")
    if not (isinstance(nbytes, int) and isinstance(generation, int) and isinstance(body.get("tensors"), list)):
        raise ValueError("descriptor needs int `nbytes` and `generation` and a `tensors` list")
    for t in body["tensors"]:
        if not (isinstance(t, dict) and isinstance(t.get("name"), str) and isinstance(t.get("offset"), int)
                and isinstance(t.get("shape"), list) and all(isinstance(d, int) and d >= 0 for d in t["shape"])):
            raise ValueError(f"bad tensor entry in descriptor: {str(t)[:200]}")
        end = t["offset"] + spec_nbytes(t)
        if t["offset"] < HEADER_BYTES or end > nbytes or t["offset"] % parse_dtype(t["dtype"]).itemsize:
            raise ValueError(f"tensor {t['name']} at bytes [{t['offset']}, {end}) lies outside the "
                             f"{nbytes}-byte buffer's data or is misaligned")
    return body


def shm_path(name: Any) -> str:
    if not isinstance(name, str) or not _SHM_NAME.match(name) or name in (".", ".."):
        raise ValueError(f"shared-memory name {name!r:.80} must match {_SHM_NAME.pattern} (not . or ..)")
    return os.path.join(SHM_DIR, name)


def create_shm(name: str, nbytes: int) -> int:
    """A new named /dev/shm file of `nbytes`; returns an open fd. An old file of that name
    is unlinked first, never truncated: a reader still mapping it keeps valid memory."""
    path = shm_path(name)
    if os.path.exists(path):
        os.unlink(path)
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    os.ftruncate(fd, nbytes)
    return fd


def map_fd(fd: int) -> torch.Tensor:
    """The whole file as a shared uint8 tensor, pages mapped up front (MAP_POPULATE) so the
    first use pays no page faults. The mapping lives as long as the tensor or a view of it."""
    size = os.fstat(fd).st_size
    mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0))
    return torch.frombuffer(mm, dtype=torch.uint8)


def file_identity(fd_or_path: int | str) -> tuple[int, int]:
    st = os.fstat(fd_or_path) if isinstance(fd_or_path, int) else os.stat(fd_or_path)
    return st.st_ino, st.st_size


def try_lock(fd: int, exclusive: bool) -> bool:
    """Non-blocking flock; False if another process holds a conflicting lock."""
    try:
        fcntl.flock(fd, (fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH) | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False


def unlock(fd: int) -> None:
    fcntl.flock(fd, fcntl.LOCK_UN)


def write_header(buf: torch.Tensor, generation: int, nbytes: int) -> None:
    buf[:24].view(torch.int64).copy_(torch.tensor([MAGIC, generation, nbytes], dtype=torch.int64))


def read_generation(buf: torch.Tensor) -> int | None:
    magic, generation, _ = buf[:24].view(torch.int64).tolist()
    return generation if magic == MAGIC else None


def span(tensors: list[torch.Tensor]) -> torch.Tensor | None:
    """One flat view over `tensors` if they lie back to back, in this order, in one storage
    (same dtype, each contiguous): a flattened bucket's bytes with no copy. Else None."""
    if not tensors:
        return None
    first, pos = tensors[0], tensors[0].storage_offset()
    base = first.untyped_storage().data_ptr()
    for t in tensors:
        if (t.dtype != first.dtype or not t.is_contiguous() or t.storage_offset() != pos
                or t.untyped_storage().data_ptr() != base):
            return None
        pos += t.numel()
    return torch.as_strided(first, (pos - first.storage_offset(),), (1,))


def view(buf: torch.Tensor, offset: int, spec: Spec) -> torch.Tensor:
    """The tensor `spec` stored at byte `offset` of a flat uint8 buffer (no copy)."""
    n = spec_nbytes(spec)
    return buf[offset:offset + n].view(parse_dtype(spec["dtype"])).view(spec["shape"])


def copy_all(targets: list[torch.Tensor], sources: list[torch.Tensor]) -> None:
    """targets[i].copy_(sources[i]) for all i: one multi-tensor copy where dtypes and devices
    match (on a GPU, 200 separate copies of a bucket cost ~5 ms of launches; measured in
    bench/results/cuda_ipc_sync_phases.txt), else one by one (converting). Both sides of the
    tensor transport use it: the engine into its shadows, the trainer into a CUDA buffer."""
    same = [i for i, (t, s) in enumerate(zip(targets, sources)) if t.dtype == s.dtype and t.device == s.device]
    if same:
        torch._foreach_copy_([targets[i] for i in same], [sources[i] for i in same])
    for i in sorted(set(range(len(targets))) - set(same)):
        targets[i].copy_(sources[i])


def adjacent(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Does `b` start where `a` ends, in the same storage, both contiguous and of one dtype?
    (packing.CopyRuns' runs)"""
    return (a.dtype == b.dtype and a.is_contiguous() and b.is_contiguous()
            and a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
            and b.storage_offset() == a.storage_offset() + a.numel())


_WIDE = (torch.int64, torch.int32, torch.int16)  # 8-, 4- and 2-byte elements, widest first


def pack_into(flat: torch.Tensor, tensors: list[torch.Tensor]) -> int:
    """flat (1-D uint8) <- the tensors' bytes back to back from its start (`offsets` order), by
    one concatenation with `out=` (a batched copy kernel: the trainer's side of a bucket,
    where a multi-tensor copy of 201 tensors took ~5 ms on the H200 against ~0.6 ms for one
    copy of the same bytes). Returns the bytes written. Every tensor is on flat's device.
    The bytes are concatenated as the widest integer every piece and flat's start can be
    viewed as (`wide_view`): on the H100 a uint8 concatenation of a 3.4 GB bucket set ran at
    ~170 GB/s (cuda_ipc_sync_3gb.txt), as if each thread moved one byte at a time."""
    inputs, out = concatenation(flat, tensors)
    torch.cat(inputs, out=out)
    return out.numel() * out.element_size()


def concatenation(flat: torch.Tensor, tensors: list[torch.Tensor]) -> tuple[list[torch.Tensor], torch.Tensor]:
    """pack_into's views: (the inputs, the output) of the one torch.cat(inputs, out=output)
    that writes the tensors' bytes back to back from flat's start, as the widest integer
    every piece and flat's start allow. Making them costs Python per tensor (~7 ms for 841
    tensors on a CPU core, against 0.2 ms for the cat's launch): a caller that fills the same
    buffer from the same tensors each push keeps them (core/train/cuda_sender.py)."""
    pieces = [t.contiguous().reshape(-1).view(torch.uint8) for t in tensors]
    out = flat[:sum(p.numel() for p in pieces)]
    for dtype in _WIDE:
        wide = [w for w in (wide_view(p, dtype) for p in pieces + [out]) if w is not None]
        if len(wide) == len(pieces) + 1:  # every piece and flat's start allow this width
            return wide[:-1], wide[-1]
    return pieces, out


def wide_view(raw: torch.Tensor, dtype: torch.dtype) -> torch.Tensor | None:
    """A 1-D uint8 tensor's bytes as `dtype` elements (no copy), or None where its length or
    its address is not a multiple of the element size."""
    size = dtype.itemsize
    if raw.numel() % size or raw.data_ptr() % size:
        return None
    return raw.view(dtype)
