"""milepost's CUDA descriptor (core/weight_sync/cuda_buffers.py): what the engine accepts is
checked before any CUDA call, and the tensor transport agrees the format from /server_info.
Runs on CPU; tests/gpu/test_cuda_buffers_gpu.py maps real trainer storages."""

from __future__ import annotations

import base64
import json

import pytest

from milepost.core.weight_sync import cuda_buffers
from milepost.core.weight_sync.tensor import agree_format
from milepost.core.weight_sync.wire import SHM_FORMAT

STORAGE = {"device": "GPU-6f1c2b7e-0000-0000-0000-000000000000", "handle": base64.b64encode(b"\0" * 64).decode(),
           "size_bytes": 4096, "offset_bytes": 512, "ref_counter_handle": base64.b64encode(b"/torch_1_2_3").decode(),
           "ref_counter_offset": 0, "event_handle": None, "event_sync_required": False}
TENSORS = [{"name": "w", "dtype": "bfloat16", "shape": [16, 64], "offset": 0},
           {"name": "b", "dtype": "float32", "shape": [64], "offset": 2048}]


def _decoded(storage=None, tensors=None) -> dict:
    blob = cuda_buffers.encode_descriptor(storage or dict(STORAGE), tensors or [dict(t) for t in TENSORS])
    return cuda_buffers.decode_descriptor(json.loads(base64.b64decode(blob)))


def test_a_descriptor_round_trips_with_its_handles_as_bytes() -> None:
    body = _decoded()
    assert body["tensors"] == TENSORS
    assert body["storage"]["handle"] == b"\0" * 64 and body["storage"]["ref_counter_handle"] == b"/torch_1_2_3"


@pytest.mark.parametrize("storage_change, tensors, message", [
    ({"handle": "@@@"}, None, "storage.handle` is not base64"),
    ({"handle": 7}, None, "short base64 string"),
    ({"size_bytes": -1}, None, "non-negative ints"),
    ({"offset_bytes": True}, None, "non-negative ints"),
    ({"event_sync_required": 1}, None, "event_sync_required"),
    ({"device": 0}, None, "device's UUID"),
    ({}, [{"name": "w", "dtype": "bfloat16", "shape": [64, 64], "offset": 0}], "outside the 4096-byte storage"),
    ({}, [{"name": "w", "dtype": "float32", "shape": [4], "offset": 2}], "misaligned"),
    ({}, [{"name": "w", "dtype": "complex64", "shape": [4], "offset": 0}], "unknown dtype"),
    ({}, [{"name": "w", "dtype": "float32", "shape": [-4], "offset": 0}], "bad tensor entry"),
])
def test_a_bad_descriptor_is_refused_by_name(storage_change, tensors, message) -> None:
    with pytest.raises(ValueError, match=message):
        _decoded({**STORAGE, **storage_change}, tensors)


def test_a_well_formed_storage_is_still_checked_for_a_visible_device_before_mapping() -> None:
    """The mapping goes through cuda_ipc.rebuild_cuda_tensor: a device this process cannot see
    is refused before any CUDA call (a colocated engine shares the trainer's GPU)."""
    import pickle
    with pytest.raises(pickle.UnpicklingError, match="not visible to this process"):
        cuda_buffers.MappedStorages().storage(_decoded())


@pytest.mark.parametrize("formats, agreed", [
    ([[SHM_FORMAT], [SHM_FORMAT]], "shm"),
    ([[cuda_buffers.CUDA_FORMAT], [cuda_buffers.CUDA_FORMAT]], "cuda"),
    ([[cuda_buffers.CUDA_FORMAT], []], "sglang"),  # one SGLang engine: every engine gets SGLang's
    ([[SHM_FORMAT], [cuda_buffers.CUDA_FORMAT]], "sglang"),
    ([None], "sglang"),
    ([], "sglang"),
])
def test_the_transport_sends_the_format_every_engine_lists(formats, agreed) -> None:
    assert agree_format([{"tensor_formats": f} for f in formats]) == agreed


def test_a_release_unmaps_only_the_storages_the_last_push_did_not_read(monkeypatch) -> None:
    """MappedStorages.sweep (a memory release): what the last push read stays mapped (colocated
    placement releases before every push; mapping again costs ~1.1 ms per GB), the rest goes.
    CPU: the IPC mapping itself is replaced by a counter of how often a storage was opened."""
    import torch
    opened: list[bytes] = []

    def rebuild(*args, **kwargs):
        opened.append(args[7])  # the handle
        return torch.empty(args[1][0], dtype=torch.uint8)
    monkeypatch.setattr(cuda_buffers.cuda_ipc, "rebuild_cuda_tensor", rebuild)
    old, new = _decoded({**STORAGE, "handle": base64.b64encode(b"\1" * 64).decode()}), _decoded()
    mapped = cuda_buffers.MappedStorages()
    mapped.new_push()
    mapped.storage(old)  # a push reads a storage the trainer later replaces
    mapped.new_push()
    mapped.storage(new)
    assert mapped.sweep() == 1 and len(mapped) == 1  # the release: `old` unmapped, `new` kept
    mapped.new_push()
    mapped.storage(new)
    assert opened == [b"\1" * 64, b"\0" * 64]  # `new` was not opened again after the release
    assert mapped.sweep() == 0
