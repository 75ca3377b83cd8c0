"""SGLang's `/update_weights_from_tensor` payload, written and read without importing SGLang.

Format (sglang 0.5.23): `serialized_named_tensors` holds one entry per engine TP rank; TP
rank r base64-decodes entry r and unpickles it with `MultiprocessingSerializer.deserialize`
(srt/utils/common.py:3085, through its allow-list `SafeUnpickler`, common.py:3144;
srt/managers/tp_worker.py:194 `deserialize_own_rank`). With `load_format:
"flattened_bucket"` the object is `{"flattened_tensor": <uint8 tensor>, "metadata":
[FlattenedTensorMetadata(name, shape, dtype, start_idx, end_idx, numel)]}`
(model_runner_components/weight_updater.py:383; srt/weight_sync/tensor_bucket.py): each
tensor is `flattened_tensor[start_idx:end_idx].view(dtype).reshape(shape)`. The pickle is
torch's multiprocessing reductions (`ForkingPickler`): CUDA IPC handles on GPU, the device
by UUID (cuda_ipc.py). On CPU the
storage travels by torch's `file_system` sharing (`rebuild_storage_filename`: a named
shared-memory segment tracked by torch_shm_manager), which works between unrelated
processes; torch's default `file_descriptor` strategy does not (FACTS.md).

Writing (`encode`): milepost's own pickler emits exactly that, naming SGLang's
`sglang.srt.weight_sync.tensor_bucket.FlattenedTensorMetadata` for the stand-in class
below, and sharing CPU storages by `file_system` whatever the process's global strategy.

Reading (`decode`, the built-in engine): an allow-list unpickler. Only these globals load
(anything else raises before any of it runs, so a request can never run code):
torch.multiprocessing.reductions `rebuild_tensor`, `rebuild_typed_storage`,
`rebuild_storage_filename` (each wrapped: argument types, dtypes of wire.DTYPES, a segment
name of torch's pattern `/torch_<pid>_<n>_<n>` that exists in /dev/shm and holds the size
claimed, a manager socket named `manager.sock`, a tensor inside its storage),
`torch.Tensor`, `torch.Size`, `torch.storage.UntypedStorage`, the dtypes of wire.DTYPES,
SGLang's `FlattenedTensorMetadata` (read into the stand-in), and on GPU
`rebuild_cuda_tensor` (torch's or SGLang's patched name; cuda_ipc checks its arguments)
with `torch.storage.TypedStorage` read as a marker, never as a class. Then the object's shape
is checked: the two keys, a 1-D uint8 tensor, metadata inside it.
"""

from __future__ import annotations

import base64
import copyreg
import functools
import io
import os
import pickle
import re
from dataclasses import dataclass
from typing import Any

import torch

from milepost.core.weight_sync import cuda_ipc, wire

SGLANG_METADATA = ("sglang.srt.weight_sync.tensor_bucket", "FlattenedTensorMetadata")
_SEGMENT = re.compile(rb"^/torch_\d+_\d+_\d+$")
_MANAGER = re.compile(rb"^/[A-Za-z0-9_./-]{1,400}/manager\.sock$")


@dataclass
class FlattenedTensorMetadata:
    """SGLang's class of the same name (fields in its order); pickled under SGLang's name."""

    name: str
    shape: torch.Size
    dtype: torch.dtype
    start_idx: int
    end_idx: int
    numel: int


def metadata(specs: list[wire.Spec]) -> list[FlattenedTensorMetadata]:
    """Each spec's place in a flattened bucket (bytes back to back, as wire.offsets)."""
    offs, _ = wire.offsets(specs)
    return [FlattenedTensorMetadata(s["name"], torch.Size(s["shape"]), wire.parse_dtype(s["dtype"]), o,
                                    o + wire.spec_nbytes(s), wire.spec_nbytes(s)) for s, o in zip(specs, offs)]


# ---- writing ----
def _reduce_storage_file_system(storage: torch.UntypedStorage) -> tuple[Any, tuple]:
    """torch's reduce_storage, `file_system` branch (torch/multiprocessing/reductions.py)."""
    from torch.multiprocessing.reductions import rebuild_storage_filename
    if storage.device.type != "cpu":
        raise ValueError("the CPU payload shares CPU storages; on GPU SGLang takes CUDA IPC handles")
    meta = storage._share_filename_cpu_()
    storage._shared_incref()
    return rebuild_storage_filename, (type(storage),) + meta


def _reduce_tensor(tensor: torch.Tensor) -> tuple[Any, tuple]:
    """CUDA: by IPC handle, the device by UUID; CPU: torch's reduction (its storage by
    `_reduce_storage_file_system`)."""
    if tensor.is_cuda:
        return cuda_ipc.reduce_cuda_tensor(tensor)
    from torch.multiprocessing.reductions import reduce_tensor
    return reduce_tensor(tensor)


# pickle's pure-Python Pickler, whose internals used below (save, write, memoize, save_global)
# typeshed leaves out
_PurePickler: Any = pickle._Pickler


class _Pickler(_PurePickler):
    """ForkingPickler's reductions, CPU storages by file_system, the stand-in metadata
    class under SGLang's module and name."""

    def __init__(self, file: io.BytesIO) -> None:
        super().__init__(file, protocol=4)
        from multiprocessing.reduction import ForkingPickler

        import torch.multiprocessing.reductions  # registers torch's reducers
        reducers = ForkingPickler._extra_reducers  # type: ignore[attr-defined]  # private: where torch registers
        self.dispatch_table = {**copyreg.dispatch_table, **reducers,
                               torch.UntypedStorage: _reduce_storage_file_system, torch.Tensor: _reduce_tensor}

    def save_global(self, obj: Any, name: str | None = None) -> None:
        if obj is FlattenedTensorMetadata:
            self.save(SGLANG_METADATA[0])
            self.save(SGLANG_METADATA[1])
            self.write(pickle.STACK_GLOBAL)
            self.memoize(obj)
            return
        super().save_global(obj, name)


def shared_buffer(nbytes: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """A 1-D uint8 buffer to write buckets into and `encode` again and again with no copy.
    On a GPU a plain CUDA allocation (shared by IPC handle when encoded); on CPU a named
    shared-memory segment (torch's file_system sharing). Not
    `share_memory_()`: under torch's default strategy that shares by file descriptor, and
    the name such a storage reports later does not exist (measured: a second push failed
    with "unable to open shared memory object")."""
    if torch.device(device).type == "cuda":
        return torch.empty(nbytes, dtype=torch.uint8, device=device)
    flat = torch.empty(nbytes, dtype=torch.uint8)
    flat.untyped_storage()._share_filename_cpu_()
    return flat


def encode(flat: torch.Tensor, specs: list[wire.Spec]) -> str:
    """The base64 payload of one flattened bucket: `flat` (1-D uint8, CPU or CUDA) holds
    `specs` back to back, in a `shared_buffer` (a storage not yet shared moves into a named segment:
    a copy; one shared by file descriptor, e.g. by `share_memory_()`, names a segment that
    is gone by the next push)."""
    if flat.dtype != torch.uint8 or flat.dim() != 1:
        raise ValueError("a flattened bucket is a 1-D uint8 tensor")
    buf = io.BytesIO()
    _Pickler(buf).dump({"flattened_tensor": flat, "metadata": metadata(specs)})
    return base64.b64encode(buf.getvalue()).decode()


# ---- reading: the allow-list ----
def _rebuild_storage_filename(cls: Any, manager: Any, handle: Any, size: Any, dtype: Any = None) -> Any:
    from torch.multiprocessing.reductions import rebuild_storage_filename
    if cls is not torch.UntypedStorage or dtype is not None:
        raise pickle.UnpicklingError("shared storage must be an UntypedStorage")
    if not (isinstance(manager, bytes) and _MANAGER.match(manager) and b".." not in manager):
        raise pickle.UnpicklingError(f"torch shm manager socket {manager!r:.120} is not torch's")
    if not (isinstance(handle, bytes) and _SEGMENT.match(handle)):
        raise pickle.UnpicklingError(f"shared-memory segment {handle!r:.120} is not torch's (/torch_<pid>_<n>_<n>)")
    if not (isinstance(size, int) and 0 <= size <= MAX_SEGMENT_BYTES):
        raise pickle.UnpicklingError(f"segment size {size!r:.40} out of range")
    try:  # mapping more than the segment holds would crash the reader (SIGBUS) on first touch
        actual = os.stat(wire.SHM_DIR + handle.decode()).st_size
    except OSError as exc:
        raise pickle.UnpicklingError(f"shared-memory segment {handle.decode()} is not there: {exc}") from None
    if actual < size:
        raise pickle.UnpicklingError(f"segment {handle.decode()} holds {actual} bytes, the payload says {size}")
    return rebuild_storage_filename(cls, manager, handle, size)


def _rebuild_typed_storage(storage: Any, dtype: Any) -> Any:
    from torch.multiprocessing.reductions import rebuild_typed_storage
    if not isinstance(storage, torch.UntypedStorage) or dtype not in _DTYPES:
        raise pickle.UnpicklingError("typed storage needs an UntypedStorage and a known dtype")
    return rebuild_typed_storage(storage, dtype)


def _rebuild_tensor(cls: Any, storage: Any, meta: Any) -> Any:
    from torch.multiprocessing.reductions import rebuild_tensor
    if cls is not torch.Tensor or not isinstance(storage, torch.TypedStorage):
        raise pickle.UnpicklingError("only plain tensors over shared storage")
    ok = (isinstance(meta, tuple) and len(meta) == 4 and isinstance(meta[0], int) and meta[0] >= 0
          and isinstance(meta[1], torch.Size) and isinstance(meta[2], tuple)
          and all(isinstance(x, int) and x >= 0 for x in meta[2]) and len(meta[2]) == len(meta[1])
          and meta[3] is False)
    if not ok:
        raise pickle.UnpicklingError("bad tensor metadata")
    end = meta[0] + sum((d - 1) * s for d, s in zip(meta[1], meta[2])) + 1 if all(meta[1]) else meta[0]
    if end > storage._size():
        raise pickle.UnpicklingError("tensor lies outside its storage")
    return rebuild_tensor(cls, storage, meta)


MAX_SEGMENT_BYTES = 1 << 40
_DTYPES = set(wire.DTYPES.values())
_ALLOWED: dict[tuple[str, str], Any] = {
    ("torch.multiprocessing.reductions", "rebuild_tensor"): _rebuild_tensor,
    ("torch.multiprocessing.reductions", "rebuild_typed_storage"): _rebuild_typed_storage,
    ("torch.multiprocessing.reductions", "rebuild_storage_filename"): _rebuild_storage_filename,
    ("torch", "Tensor"): torch.Tensor, ("torch", "Size"): torch.Size,
    ("torch.storage", "UntypedStorage"): torch.UntypedStorage, ("torch", "UntypedStorage"): torch.UntypedStorage,
    SGLANG_METADATA: FlattenedTensorMetadata,
    cuda_ipc.REBUILD: functools.partial(cuda_ipc.rebuild_cuda_tensor, dtypes=_DTYPES),
    cuda_ipc.SGLANG_REBUILD: functools.partial(cuda_ipc.rebuild_cuda_tensor, dtypes=_DTYPES),
    ("torch.storage", "TypedStorage"): cuda_ipc.STORAGE_CLASS,
    **{("torch", name): dtype for name, dtype in wire.DTYPES.items()},
}


class _AllowListUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        try:
            return _ALLOWED[(module, name)]
        except KeyError:
            raise pickle.UnpicklingError(f"{module}.{name} is not on the allow-list of a pickled weight payload "
                                         "(torch's tensor rebuild functions and SGLang's metadata only)") from None


def looks_like_pickle(raw: bytes) -> bool:
    return len(raw) >= 2 and raw[0] == 0x80 and raw[1] <= pickle.HIGHEST_PROTOCOL


def decode(raw: bytes) -> tuple[torch.Tensor, list[wire.Spec]]:
    """A flattened-bucket payload (raw pickle bytes) → (flat uint8 tensor, specs with
    their byte offsets as `offset`). ValueError names what is wrong; nothing outside the
    allow-list is ever called."""
    try:
        obj = _AllowListUnpickler(io.BytesIO(raw)).load()
    except Exception as exc:  # noqa: BLE001 - any failure is the request's
        raise ValueError(f"serialized_named_tensors: not an SGLang flattened bucket this engine accepts: "
                         f"{type(exc).__name__}: {exc}") from None
    if not (isinstance(obj, dict) and set(obj) == {"flattened_tensor", "metadata"}):
        raise ValueError("a flattened bucket is {'flattened_tensor', 'metadata'}")
    flat, metas = obj["flattened_tensor"], obj["metadata"]
    if not (isinstance(flat, torch.Tensor) and flat.dtype == torch.uint8 and flat.dim() == 1
            and isinstance(metas, list) and metas):
        raise ValueError("flattened_tensor must be a 1-D uint8 tensor and metadata a non-empty list")
    specs = []
    for m in metas:
        if not (isinstance(m, FlattenedTensorMetadata) and isinstance(m.name, str) and m.dtype in _DTYPES
                and isinstance(m.shape, torch.Size) and isinstance(m.start_idx, int)):
            raise ValueError(f"bad metadata entry {str(m)[:200]}")
        spec = {"name": m.name, "dtype": wire.dtype_name(m.dtype), "shape": list(m.shape), "offset": m.start_idx}
        n = wire.spec_nbytes(spec)
        if not (m.start_idx >= 0 and m.end_idx == m.start_idx + n == m.start_idx + m.numel
                and m.end_idx <= flat.numel() and m.start_idx % m.dtype.itemsize == 0):
            raise ValueError(f"{m.name}: bytes [{m.start_idx}, {m.end_idx}) do not fit its shape and dtype "
                             f"inside the {flat.numel()}-byte bucket")
        specs.append(spec)
    return flat, specs

