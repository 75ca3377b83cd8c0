"""CUDA tensors in SGLang's pickled weight payload: CUDA IPC handles, devices by UUID.

What SGLang 0.5.23 expects on GPU (read from its wheel): a colocated trainer pickles each
CUDA tensor with torch's `reduce_tensor` (torch/multiprocessing/reductions.py), which
shares the tensor's CUDA allocation by an IPC handle and rebuilds it with
`rebuild_cuda_tensor(tensor_cls, size, stride, offset, storage_cls, dtype, device, handle,
storage_size_bytes, storage_offset_bytes, requires_grad, ref_counter_handle,
ref_counter_offset, event_handle, event_sync_required)`. Both sides first call
`sglang.srt.utils.patch_torch.monkey_patch_torch_reductions`, which puts the device's UUID
in place of its index (argument 6): the trainer and the engine see different
`CUDA_VISIBLE_DEVICES`, so index 0 in one process is not index 0 in the other. The engine's
TP worker applies the patch before it unpickles (srt/managers/tp_worker.py:198), so its
`rebuild_cuda_tensor` takes a UUID or an index.

Writing: `reduce_cuda_tensor` gives torch's reduction with the device as its UUID, under
torch's own global name (`torch.multiprocessing.reductions.rebuild_cuda_tensor`), which an
SGLang engine resolves to its patched function; milepost patches nothing process-wide.
The trainer keeps the bucket alive and unchanged until the engines answered (they copy
it in before they do), as for the CPU payload.

Reading (the built-in engine): `rebuild_cuda_tensor` checks every argument's type, maps a
UUID to this process's device index, and only then calls torch's function. The storage
class arrives as a marker (`STORAGE_CLASS`), never as a callable class, so a payload cannot
construct storages of its own.
"""

from __future__ import annotations

import pickle
from typing import Any

import torch

DEVICE_ARG = 6  # position of the device in rebuild_cuda_tensor's arguments
REBUILD = ("torch.multiprocessing.reductions", "rebuild_cuda_tensor")
SGLANG_REBUILD = ("sglang.srt.utils.patch_torch", "_rebuild_cuda_tensor_modified")


class _StorageClassMarker:
    """Stands for torch.storage.TypedStorage inside a payload (what reduce_tensor names)."""


STORAGE_CLASS = _StorageClassMarker()


def device_uuid(index: int) -> str:
    return str(torch.cuda.get_device_properties(index).uuid)


def device_index(device: int | str) -> int:
    """This process's index of a device named by index or UUID (ValueError when not visible)."""
    if isinstance(device, int) and not isinstance(device, bool):
        if 0 <= device < torch.cuda.device_count():
            return device
        raise ValueError(f"CUDA device {device} is not visible here ({torch.cuda.device_count()} visible)")
    if isinstance(device, str):
        for index in range(torch.cuda.device_count()):
            if device_uuid(index) == device:
                return index
        raise ValueError(f"CUDA device {device[:64]} is not visible to this process: a tensor payload "
                         "by CUDA IPC needs the engine on the trainer's GPU (colocated)")
    raise ValueError(f"a CUDA device is an index or a UUID, not {type(device).__name__}")


def reduce_cuda_tensor(tensor: torch.Tensor) -> tuple[Any, tuple]:
    """torch's reduction of a CUDA tensor, its device given by UUID (as SGLang's patch does).
    The rebuild function is whatever torch's module holds now: torch's own (pickled under
    its name), or SGLang's patched one where this process applied the patch."""
    from torch.multiprocessing import reductions
    original = getattr(reductions, "_reduce_tensor_original", reductions.reduce_tensor)
    rebuild, args = original(tensor)
    if getattr(rebuild, "__name__", "") not in (REBUILD[1], SGLANG_REBUILD[1]):
        raise ValueError(f"torch reduced a CUDA tensor with {rebuild!r}, not rebuild_cuda_tensor")
    args = args[:DEVICE_ARG] + (device_uuid(args[DEVICE_ARG]),) + args[DEVICE_ARG + 1:]
    return reductions.rebuild_cuda_tensor, args


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= 0


def rebuild_cuda_tensor(tensor_cls: Any, size: Any, stride: Any, offset: Any, storage_cls: Any, dtype: Any,
                        device: Any, handle: Any, storage_size_bytes: Any, storage_offset_bytes: Any,
                        requires_grad: Any, ref_counter_handle: Any, ref_counter_offset: Any, event_handle: Any,
                        event_sync_required: Any, *, dtypes: set[torch.dtype]) -> torch.Tensor:
    """torch's rebuild_cuda_tensor after checking what the payload claims (UnpicklingError)."""
    if tensor_cls is not torch.Tensor or storage_cls is not STORAGE_CLASS:
        raise pickle.UnpicklingError("a CUDA payload holds plain tensors over a typed storage only")
    if not (isinstance(size, torch.Size) and isinstance(stride, tuple) and len(stride) == len(size)
            and all(_is_int(s) for s in stride) and _is_int(offset)):
        raise pickle.UnpicklingError("bad CUDA tensor geometry")
    if dtype not in dtypes or requires_grad is not False:
        raise pickle.UnpicklingError(f"CUDA tensor of dtype {dtype!r:.40} (requires_grad {requires_grad!r:.10})")
    if not (isinstance(handle, bytes) and _is_int(storage_size_bytes) and _is_int(storage_offset_bytes)
            and isinstance(ref_counter_handle, bytes) and _is_int(ref_counter_offset)
            and (event_handle is None or isinstance(event_handle, bytes)) and isinstance(event_sync_required, bool)):
        raise pickle.UnpicklingError("bad CUDA IPC handles")
    end = offset + sum((d - 1) * s for d, s in zip(size, stride)) + 1 if all(size) else offset
    if end * dtype.itemsize > storage_size_bytes:
        raise pickle.UnpicklingError("CUDA tensor lies outside its storage")
    try:
        index = device_index(device)
    except ValueError as exc:
        raise pickle.UnpicklingError(str(exc)) from None
    from torch.multiprocessing import reductions
    original = getattr(reductions, "_rebuild_cuda_tensor_original", reductions.rebuild_cuda_tensor)
    return original(torch.Tensor, size, stride, offset, torch.storage.TypedStorage, dtype, index, handle,
                    storage_size_bytes, storage_offset_bytes, False, ref_counter_handle, ref_counter_offset,
                    event_handle, event_sync_required)
