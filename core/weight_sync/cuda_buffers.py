"""milepost's CUDA weight buffers for the `tensor` transport: mapped once, named by JSON.

Why: SGLang's colocated payload (sglang_wire, cuda_ipc) pickles a fresh CUDA IPC handle and
event for every bucket of every push, and the engine opens the handle again each time.
Measured on the H200 (bench/results/cuda_ipc_sync_phases.txt): ~5.5 ms per bucket to pickle
a handle, while copying a whole mapped 512 MB bucket takes 0.27 ms. Here the trainer exports
each CUDA storage it sends from once (torch's `_share_cuda_`, through
cuda_ipc.reduce_cuda_tensor), the engine maps it once and keeps the mapping, and every push
after the first sends only JSON: which storage, and where each tensor lies in it.

Descriptor (base64 of JSON, one per receiving TP rank, as `serialized_named_tensors`):
    {"format": "milepost-cuda-v1",
     "storage": {"device": uuid, "handle": b64, "size_bytes": int, "offset_bytes": int,
                 "ref_counter_handle": b64, "ref_counter_offset": int,
                 "event_handle": b64 | null, "event_sync_required": bool},
     "tensors": [{"name", "dtype", "shape", "offset"}]}      offset: bytes into the storage
Allow-list (what the engine reads, and nothing else): the keys above with those types,
dtypes of wire.DTYPES, every tensor inside the storage and aligned to its dtype. The storage
is rebuilt through cuda_ipc.rebuild_cuda_tensor (which checks the device by UUID).

Ordering rules, beside the code that keeps them:
- The trainer's bytes are complete before the engine reads them: the sender synchronises
  its stream after writing and before returning descriptors (`WeightSender.to_cuda`); the
  IPC event is waited on only at the first mapping.
- The trainer does not rewrite a storage while an engine reads it: an engine answers
  /update_weights_from_tensor only after its copy out of the mapping has finished
  (`core/engine/cuda_staging.py` synchronises), and the transport sends a bucket's next
  contents only in a later push.
- One export per (storage, reader), kept for the storage's life (`WeightSender.to_cuda`):
  torch counts an export's readers by a shared counter that a mapping gives back when it is
  freed. An engine that dropped a mapping (memory release, MAX_MAPPED) and maps the same
  export again gives it back twice; at worst that lets the trainer's allocator reuse the
  memory while the stale mapping is still cached here, and a cached mapping is read only
  for a descriptor naming the same handle and offset, i.e. memory the trainer exported
  again, so what is read is what the trainer wrote.
"""

from __future__ import annotations

import base64
import json
from collections import OrderedDict
from typing import Any

import torch

from milepost.core.weight_sync import cuda_ipc, wire

CUDA_FORMAT = "milepost-cuda-v1"
MAX_MAPPED = 64  # storages an engine keeps mapped (a trainer sends from a few: buckets or packed weights)
_B64 = ("handle", "ref_counter_handle")
_INTS = ("size_bytes", "offset_bytes", "ref_counter_offset")


def export_storage(tensor: torch.Tensor) -> dict[str, Any]:
    """The JSON form of one CUDA IPC export of `tensor`'s whole storage (the device by
    UUID). Each call is a new export, which one reader maps once."""
    whole = torch.empty(0, dtype=torch.uint8, device=tensor.device).set_(tensor.untyped_storage())
    _, args = cuda_ipc.reduce_cuda_tensor(whole)
    (_, _, _, _, _, _, device, handle, size_bytes, offset_bytes, _, ref_counter_handle, ref_counter_offset,
     event_handle, event_sync_required) = args
    return {"device": device, "handle": _b64(handle), "size_bytes": size_bytes, "offset_bytes": offset_bytes,
            "ref_counter_handle": _b64(ref_counter_handle), "ref_counter_offset": ref_counter_offset,
            "event_handle": None if event_handle is None else _b64(event_handle),
            "event_sync_required": bool(event_sync_required)}


def encode_descriptor(storage: dict[str, Any], tensors: list[wire.Spec]) -> str:
    """`tensors`: specs with a byte `offset` into the exported storage."""
    body = {"format": CUDA_FORMAT, "storage": storage, "tensors": tensors}
    return base64.b64encode(json.dumps(body).encode()).decode()


def decode_descriptor(body: Any) -> dict[str, Any]:
    """Check a parsed descriptor against the allow-list; ValueError names what is wrong."""
    if not isinstance(body, dict) or body.get("format") != CUDA_FORMAT:
        raise ValueError(f"not a {CUDA_FORMAT} descriptor")
    storage = body.get("storage")
    if not isinstance(storage, dict) or not isinstance(storage.get("device"), str):
        raise ValueError(f"a {CUDA_FORMAT} descriptor needs a `storage` object with the device's UUID")
    for key in _B64:
        storage[key] = _unb64(storage.get(key), key)
    if storage.get("event_handle") is not None:
        storage["event_handle"] = _unb64(storage["event_handle"], "event_handle")
    if not all(isinstance(storage.get(k), int) and not isinstance(storage.get(k), bool) and storage[k] >= 0
               for k in _INTS) or not isinstance(storage.get("event_sync_required"), bool):
        raise ValueError(f"`storage` needs non-negative ints {', '.join(_INTS)} and a bool event_sync_required")
    tensors = body.get("tensors")
    if not isinstance(tensors, list):
        raise ValueError("descriptor needs a `tensors` list")
    for t in tensors:
        if not (isinstance(t, dict) and isinstance(t.get("name"), str) and isinstance(t.get("offset"), int)
                and t["offset"] >= 0 and isinstance(t.get("shape"), list)
                and all(isinstance(d, int) and d >= 0 for d in t["shape"])):
            raise ValueError(f"bad tensor entry in descriptor: {str(t)[:200]}")
        end = t["offset"] + wire.spec_nbytes(t)
        if end > storage["size_bytes"] or t["offset"] % wire.parse_dtype(t["dtype"]).itemsize:
            raise ValueError(f"tensor {t['name']} at bytes [{t['offset']}, {end}) lies outside the "
                             f"{storage['size_bytes']}-byte storage or is misaligned")
    return body


def _b64(raw: bytes) -> str:
    return base64.b64encode(raw).decode()


def _unb64(value: Any, key: str) -> bytes:
    if not isinstance(value, str) or len(value) > 1024:
        raise ValueError(f"`storage.{key}` must be a short base64 string")
    try:
        return base64.b64decode(value, validate=True)
    except ValueError as exc:
        raise ValueError(f"`storage.{key}` is not base64: {exc}") from None


class MappedStorages:
    """The engine's mappings of trainer storages, by export, oldest dropped beyond MAX_MAPPED.
    Not thread-safe: the receiver's update lock serialises its callers."""

    def __init__(self) -> None:
        self._mapped: OrderedDict[tuple[bytes, int], torch.Tensor] = OrderedDict()
        self._used: set[tuple[bytes, int]] = set()  # read since the last push began (new_push)

    def storage(self, descriptor: dict[str, Any]) -> torch.Tensor:
        """The described storage as a 1-D uint8 CUDA tensor, mapped at its export's first use."""
        s = descriptor["storage"]
        key = (s["handle"], s["offset_bytes"])
        mapped = self._mapped.get(key)
        if mapped is None or mapped.numel() != s["size_bytes"]:
            mapped = cuda_ipc.rebuild_cuda_tensor(
                torch.Tensor, torch.Size([s["size_bytes"]]), (1,), 0, cuda_ipc.STORAGE_CLASS, torch.uint8,
                s["device"], s["handle"], s["size_bytes"], s["offset_bytes"], False, s["ref_counter_handle"],
                s["ref_counter_offset"], s["event_handle"], s["event_sync_required"], dtypes={torch.uint8})
            self._mapped[key] = mapped
            while len(self._mapped) > MAX_MAPPED:
                self._mapped.popitem(last=False)
        self._mapped.move_to_end(key)
        self._used.add(key)
        return mapped

    def new_push(self) -> None:
        """A weight-update session begins: sweep() keeps what it reads from here on."""
        self._used.clear()

    def sweep(self) -> int:
        """Unmap every storage the last push did not read (at a memory release, and at the commit
        of a push of every tensor); returns how many.
        Why keep the rest: colocated placement releases before every push, and opening a
        trainer storage again cost ~1.1 ms per GB on the lent H100 (a 3.4 GB push's load took
        6.3 ms against 2.6 ms mapped; bench/results/cuda_ipc_sync_3gb.txt). What the last push
        read, the trainer keeps anyway (its packed weights or its reused bucket buffers), so
        the mapping holds no memory the trainer would get back; a storage it replaced (or a
        dead trainer's) is unmapped here, at the next whole push or release."""
        stale = [key for key in self._mapped if key not in self._used]
        for key in stale:
            del self._mapped[key]
        return len(stale)

    def __len__(self) -> int:
        return len(self._mapped)
