"""The built-in engine's reading of a CUDA-IPC weight payload: every argument of torch's
`rebuild_cuda_tensor` is checked before any CUDA call (runs on CPU; tests/gpu has the real IPC)."""

from __future__ import annotations

import io

import pytest
import torch

from milepost.core.weight_sync import sglang_wire
from milepost.core.weight_sync.sglang_wire import FlattenedTensorMetadata


class _CudaTensorLike:
    """Pickles as torch's reduction of a CUDA uint8 bucket, with chosen arguments."""

    def __init__(self, **changes: object) -> None:
        args = {"tensor_cls": torch.Tensor, "size": torch.Size([64]), "stride": (1,), "offset": 0,
                "storage_cls": torch.storage.TypedStorage, "dtype": torch.uint8,
                "device": "GPU-6f1c2b7e-0000-0000-0000-000000000000", "handle": b"\x00" * 64,
                "storage_size_bytes": 64, "storage_offset_bytes": 0, "requires_grad": False,
                "ref_counter_handle": b"/torch_1_2_3", "ref_counter_offset": 0, "event_handle": b"\x01" * 64,
                "event_sync_required": True}
        args.update(changes)
        self.args = tuple(args.values())

    def __reduce__(self):
        from torch.multiprocessing.reductions import rebuild_cuda_tensor
        return rebuild_cuda_tensor, self.args


def _payload(tensor: object) -> bytes:
    meta = [FlattenedTensorMetadata("w", torch.Size([16]), torch.float32, 0, 64, 64)]
    buf = io.BytesIO()
    sglang_wire._Pickler(buf).dump({"flattened_tensor": tensor, "metadata": meta})
    return buf.getvalue()


@pytest.mark.parametrize("changes, message", [
    ({"tensor_cls": torch.nn.Parameter}, "Parameter is not on the allow-list"),
    ({"tensor_cls": torch.Size([1])}, "plain tensors"),
    ({"stride": (1, 1)}, "geometry"),
    ({"offset": -1}, "geometry"),
    ({"dtype": torch.complex64}, "complex64 is not on the allow-list"),
    ({"dtype": torch.Size([1])}, "dtype"),
    ({"requires_grad": True}, "requires_grad"),
    ({"handle": "not bytes"}, "IPC handles"),
    ({"event_sync_required": 1}, "IPC handles"),
    ({"size": torch.Size([65])}, "outside its storage"),
    ({"offset": 1}, "outside its storage"),
    ({}, "not visible to this process"),  # well formed, but no such GPU here
    ({"device": 3}, "not visible here"),
    ({"device": 1.5}, "index or a UUID"),
])
def test_a_cuda_payload_is_checked_before_any_cuda_call(changes, message):
    with pytest.raises(ValueError, match=message):
        sglang_wire.decode(_payload(_CudaTensorLike(**changes)))


def test_the_storage_class_of_a_cuda_payload_is_a_marker_never_a_constructor():
    class _ConstructsAStorage:
        def __reduce__(self):
            return torch.storage.TypedStorage, (16,)

    with pytest.raises(ValueError, match="not callable|flattened_tensor must be"):
        sglang_wire.decode(_payload(_ConstructsAStorage()))
