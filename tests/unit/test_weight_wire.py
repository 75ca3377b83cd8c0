"""Bucket plans and shared-memory descriptors of the tensor / distributed transports."""

from __future__ import annotations

import base64
import json

import pytest
import torch

from milepost.core.weight_sync import wire


def test_buckets_keep_order_hold_one_dtype_and_give_a_big_tensor_its_own_bucket() -> None:
    named = [("a", torch.zeros(10)), ("b", torch.zeros(10)), ("big", torch.zeros(100)),
             ("c", torch.zeros(5, dtype=torch.bfloat16)), ("d", torch.zeros(2))]
    plan = wire.plan_buckets(named, bucket_bytes=80)
    assert [[s["name"] for s in b] for b in plan] == [["a", "b"], ["big"], ["c"], ["d"]]
    assert plan[2][0] == {"name": "c", "dtype": "bfloat16", "shape": [5]}


def test_descriptor_round_trip_places_tensors_after_the_header() -> None:
    specs = [{"name": "x", "dtype": "float32", "shape": [2, 3]}, {"name": "y", "dtype": "float32", "shape": [4]}]
    blob = wire.encode_shm_descriptor("milepost-w-1-0-0", 4096, 7, specs)
    body = wire.decode_shm_descriptor(blob)
    assert [t["offset"] for t in body["tensors"]] == [wire.HEADER_BYTES, wire.HEADER_BYTES + 24]
    assert body["generation"] == 7 and body["shm_name"] == "milepost-w-1-0-0"


@pytest.mark.parametrize("change,message", [
    ({"nbytes": 70}, "outside"),                   # the tensors do not fit in the file
    ({"shm_name": "../etc/passwd"}, "must match"),  # names stay inside /dev/shm
    ({"format": "pickle"}, "descriptor"),
    ({"generation": None}, "generation"),
])
def test_bad_descriptors_are_refused(change, message) -> None:
    specs = [{"name": "x", "dtype": "float32", "shape": [4]}]
    body = json.loads(base64.b64decode(wire.encode_shm_descriptor("milepost-w-1-0-0", 4096, 7, specs)))
    blob = base64.b64encode(json.dumps({**body, **change}).encode()).decode()
    with pytest.raises(ValueError, match=message):
        wire.decode_shm_descriptor(blob)


def test_unknown_dtype_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown dtype"):
        wire.parse_dtype("float8")


def test_span_is_one_view_over_tensors_that_lie_back_to_back() -> None:
    buf = torch.arange(10, dtype=torch.float32)
    parts = [buf[0:4].view(2, 2), buf[4:5], buf[5:10]]
    flat = wire.span(parts)
    assert flat is not None and flat.data_ptr() == buf.data_ptr() and torch.equal(flat, buf)
    flat.fill_(7.0)  # a view: receiving into it fills the tensors themselves
    assert all(bool((p == 7.0).all()) for p in parts)
    tail = wire.span(parts[1:])
    assert tail is not None and tail.data_ptr() == parts[1].data_ptr() and tail.numel() == 6


@pytest.mark.parametrize("parts", [
    lambda b: [b[0:4], b[5:10]],  # a gap
    lambda b: [b[4:8], b[0:4]],  # out of order
    lambda b: [b[0:4], torch.zeros(6)],  # another storage
    lambda b: [b[0:4], b[4:10].view(2, 3).t()],  # not contiguous
    lambda b: [b[0:4], b[4:10].view(torch.int32)],  # another dtype
], ids=["gap", "order", "storage", "strided", "dtype"])
def test_span_is_none_unless_the_bytes_are_one_run(parts) -> None:
    assert wire.span(parts(torch.zeros(10))) is None
