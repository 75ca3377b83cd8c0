"""Bucket plans and shared-memory descriptors of the tensor / distributed transports."""

from __future__ import annotations

import base64
import json
import math
import os
import pickle

import pytest
import torch

from milepost.core.weight_sync import packing, wire


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


# ---- SGLang's format (sglang_wire): written by milepost, read through an allow-list only ----

def _sglang_bucket() -> tuple[torch.Tensor, list[dict], dict[str, torch.Tensor]]:
    from milepost.core.weight_sync import sglang_wire
    tensors = {"w": torch.randn(4, 3), "b": torch.arange(5, dtype=torch.bfloat16)}
    specs = [{"name": n, "dtype": wire.dtype_name(t.dtype), "shape": list(t.shape)} for n, t in tensors.items()]
    offs, total = wire.offsets(specs)
    flat = sglang_wire.shared_buffer(total)
    for s, o in zip(specs, offs):
        wire.view(flat, o, s).copy_(tensors[s["name"]])
    return flat, specs, tensors


def test_sglang_payload_round_trips_through_the_allow_list() -> None:
    from milepost.core.weight_sync import sglang_wire
    flat, specs, tensors = _sglang_bucket()
    raw = base64.b64decode(sglang_wire.encode(flat, specs))
    assert sglang_wire.looks_like_pickle(raw) and b"sglang.srt.weight_sync.tensor_bucket" in raw
    got, got_specs = sglang_wire.decode(raw)
    for s in got_specs:
        assert torch.equal(wire.view(got, s["offset"], s), tensors[s["name"]])


class _RunsCode:
    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


@pytest.mark.parametrize("payload", ["os.system", "torch.load", "builtins.eval"])
def test_sglang_payload_outside_the_allow_list_runs_nothing(payload, tmp_path) -> None:
    from milepost.core.weight_sync import sglang_wire
    marker = tmp_path / "pwned"
    obj = {"os.system": lambda: _RunsCode(str(marker)), "torch.load": lambda: torch.load,
           "builtins.eval": lambda: eval}[payload]()
    with pytest.raises(ValueError, match="allow-list"):
        sglang_wire.decode(pickle.dumps({"flattened_tensor": obj, "metadata": []}))
    assert not marker.exists()


def test_sglang_payload_claiming_more_than_its_segment_is_refused(monkeypatch) -> None:
    """Mapping past the end of a segment would crash the engine on first touch (SIGBUS)."""
    from milepost.core.weight_sync import sglang_wire
    flat, specs, _ = _sglang_bucket()
    honest = sglang_wire._reduce_storage_file_system

    def lying(storage):
        rebuild, (cls, manager, handle, size) = honest(storage)
        return rebuild, (cls, manager, handle, size * 1000)

    monkeypatch.setattr(sglang_wire, "_reduce_storage_file_system", lying)
    raw = base64.b64decode(sglang_wire.encode(flat, specs))
    with pytest.raises(ValueError, match="holds .* bytes, the payload says"):
        sglang_wire.decode(raw)


def test_copy_all_copies_every_pair_converting_where_dtypes_differ() -> None:
    sources = [torch.randn(3, 4), torch.randn(5), torch.randn(2, 2)]
    targets = [torch.empty(3, 4), torch.empty(5, dtype=torch.bfloat16), torch.empty(2, 2)]
    wire.copy_all(targets, sources)
    assert torch.equal(targets[0], sources[0]) and torch.equal(targets[2], sources[2])
    assert torch.equal(targets[1], sources[1].to(torch.bfloat16))


@pytest.mark.parametrize("layout", ["back-to-back", "separate-targets", "gap-in-source", "other-dtype",
                                    "transposed-middle"])
def test_copy_bucket_copies_each_tensor_whether_by_one_span_or_one_by_one(layout, monkeypatch) -> None:
    shapes = [[3, 4], [5], [2, 2]]
    specs, pos = [], 8
    for i, shape in enumerate(shapes):
        specs.append({"name": f"t{i}", "dtype": "float32", "shape": shape, "offset": pos})
        pos += 4 * math.prod(shape) + (16 if layout == "gap-in-source" else 0)
    flat = torch.randn((pos + 8) // 4).view(torch.uint8)  # finite floats wherever a tensor lies
    dtype = torch.bfloat16 if layout == "other-dtype" else torch.float32
    if layout == "separate-targets":
        targets = [torch.empty(shape, dtype=dtype) for shape in shapes]
    else:  # views of one buffer, in order (the engine's shadow span)
        buf, targets, at = torch.empty(sum(math.prod(x) for x in shapes), dtype=dtype), [], 0
        for shape in shapes:
            targets.append(buf[at:at + math.prod(shape)].view(shape))
            at += math.prod(shape)
    if layout == "transposed-middle":  # the last one where a span would put it, but transposed: not in the span
        targets[2] = targets[2].t()
    calls = []
    monkeypatch.setattr(wire, "copy_all", lambda t, s: calls.append(len(t)) or [a.copy_(b) for a, b in zip(t, s)])
    packing.copy_bucket(targets, flat, specs)
    expected = {"back-to-back": [], "transposed-middle": [1]}.get(layout, [3])  # spans, then the general path
    assert calls == expected
    for target, spec in zip(targets, specs):
        assert torch.equal(target, wire.view(flat, spec["offset"], spec).to(dtype))


def test_pack_into_lays_every_dtype_back_to_back_as_offsets_says() -> None:
    tensors = [torch.randn(3, 4), torch.randn(5).to(torch.bfloat16), torch.randn(2, 8).to(torch.float8_e4m3fn),
               torch.tensor(7, dtype=torch.int64), torch.randn(6, 4)[:, 1]]  # a 0-d and a strided one too
    specs = [{"name": str(i), "dtype": wire.dtype_name(t.dtype), "shape": list(t.shape)} for i, t in enumerate(tensors)]
    offs, total = wire.offsets(specs)
    flat = torch.zeros(total + 16, dtype=torch.uint8)
    assert wire.pack_into(flat, tensors) == total
    for t, spec, o in zip(tensors, specs, offs):
        raw = t.contiguous().reshape(-1).view(torch.uint8)
        assert torch.equal(flat[o:o + wire.spec_nbytes(spec)], raw)
    assert not flat[total:].any()


@pytest.mark.parametrize("sizes,start,wide", [
    ([4096, 8, 24], 0, torch.int64),  # every length and the start a multiple of 8: int64 elements
    ([4096, 12, 24], 0, torch.int32),  # one length only a multiple of 4
    ([4096, 6], 0, torch.int16),
    ([4096, 8], 3, None),  # flat's start at an odd byte: uint8, as before
])
def test_pack_into_concatenates_as_the_widest_integer_every_piece_allows_and_writes_the_same_bytes(
        sizes, start, wide, monkeypatch) -> None:
    g = torch.Generator().manual_seed(0)
    tensors = [torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g) for n in sizes]
    base = torch.zeros(sum(sizes) + start + 8, dtype=torch.uint8)
    flat = base[start:]
    seen: list[torch.dtype] = []
    real_cat = torch.cat

    def cat(pieces, out):
        seen.append(out.dtype)
        return real_cat(pieces, out=out)
    monkeypatch.setattr(wire.torch, "cat", cat)
    assert wire.pack_into(flat, tensors) == sum(sizes)
    assert seen == [wide or torch.uint8]
    assert torch.equal(flat[:sum(sizes)], real_cat(tensors)) and not flat[sum(sizes):].any() and not base[:start].any()


def test_an_engine_whose_weights_are_not_in_host_memory_refuses_the_shm_format() -> None:
    """Served in place means host memory; a GPU engine does not announce the format, and a
    descriptor sent anyway is refused before any file is opened (meta tensors stand in for
    weights on a device)."""
    from types import SimpleNamespace

    from milepost.core.engine.weight_receiver import UpdateRejected, WeightReceiver

    model = torch.nn.Linear(4, 3).to("meta")
    descriptor = {"format": wire.SHM_FORMAT, "shm_name": "milepost-w-0-0-0", "nbytes": 64, "generation": 1,
                  "tensors": [{"name": "weight", "dtype": "float32", "shape": [3, 4], "offset": 64}]}
    with pytest.raises(UpdateRejected, match=r"shm format serves host memory in place and this engine's weights "
                                             r"are on meta: send SGLang's format"):
        WeightReceiver(SimpleNamespace(model=model)).load_shm(descriptor)
