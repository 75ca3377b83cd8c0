"""The weight-update process group with several gloo streams, and the bucket order that
spreads a per-tensor bucket's bytes over them."""

from __future__ import annotations

import math
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from milepost.core.weight_sync import groups, wire
from milepost.core.weight_sync.distributed import DistributedTransport, agree_streams


def _spec(name: str, *shape: int, dtype: str = "float32") -> wire.Spec:
    return {"name": name, "dtype": dtype, "shape": list(shape)}


def _model_like_bucket() -> list[wire.Spec]:
    """A Qwen2-like bucket: one big embedding first, then layers of mixed sizes."""
    specs = [_spec("embed", 3200, 64)]
    for i in range(4):
        specs += [_spec(f"{i}.norm", 64), _spec(f"{i}.q", 64, 64), _spec(f"{i}.k", 16, 64),
                  _spec(f"{i}.up", 176, 64), _spec(f"{i}.down", 64, 176)]
    return specs


def _loads(bucket: list[wire.Spec], streams: int) -> list[int]:
    """Bytes per stream when broadcast k goes over stream k % streams."""
    return [sum(wire.spec_nbytes(s) for s in bucket[k::streams]) for k in range(streams)]


@pytest.mark.parametrize("streams", [2, 3, 4])
def test_interleave_spreads_bytes_evenly_over_the_streams(streams: int) -> None:
    layers = _model_like_bucket()[1:]
    ordered = groups.interleave(layers, streams)
    assert sorted(s["name"] for s in ordered) == sorted(s["name"] for s in layers)
    load, model_order = _loads(ordered, streams), _loads(layers, streams)
    assert max(load) - min(load) <= max(wire.spec_nbytes(s) for s in layers) // 2, load
    assert max(load) - min(load) <= max(model_order) - min(model_order)


@pytest.mark.parametrize("streams", [2, 3, 4])
def test_a_tensor_bigger_than_a_fair_share_gets_the_smallest_company(streams: int) -> None:
    bucket = _model_like_bucket()  # the embedding is most of the bytes
    ordered = groups.interleave(bucket, streams)
    load = _loads(ordered, streams)
    embed_stream = next(k for k in range(streams) if any(s["name"] == "embed" for s in ordered[k::streams]))
    others = [x for k, x in enumerate(load) if k != embed_stream]
    assert load[embed_stream] - wire.spec_nbytes(bucket[0]) <= min(others)


def test_interleave_keeps_the_order_for_one_stream() -> None:
    bucket = _model_like_bucket()
    assert groups.interleave(bucket, 1) == bucket


def test_streams_are_what_every_engine_takes() -> None:
    assert agree_streams(4, [{"max_gloo_streams": 16}, {"max_gloo_streams": 16}]) == 4
    assert agree_streams(4, [{"max_gloo_streams": 16}, {"tp_size": 1}]) == 1  # e.g. SGLang: one stream
    assert agree_streams(4, [{"max_gloo_streams": 2}]) == 2
    assert agree_streams(1, [{"max_gloo_streams": 16}]) == 1


def test_running_rank_offsets_follow_each_engines_tp_size() -> None:
    """SGLang: engine i's TP rank r joins as 1 + Σ_{j<i} tp_j + r; world = 1 + Σ tp."""
    assert groups.rank_offsets([1, 1, 1]) == ([1, 2, 3], 4)
    assert groups.rank_offsets([2, 4, 1]) == ([1, 3, 7], 8)
    with pytest.raises(ValueError, match="tp_size"):
        groups.rank_offsets([2, 0])


def test_backend_is_gloo_only_when_every_engine_runs_on_cpu() -> None:
    assert groups.choose_backend([{"device": "cpu"}, {"device": "cpu"}]) == "gloo"
    assert groups.choose_backend([{"device": "cpu"}, {"device": "cuda"}]) == "nccl"
    assert groups.choose_backend([{"tp_size": 2}]) == "nccl"  # SGLang serves from GPUs by default


def test_bad_stream_counts_are_refused() -> None:
    with pytest.raises(ValueError, match="gloo_streams=0"):
        groups.init_weight_group("127.0.0.1", 1, 0, 2, "g", 1.0, streams=0)
    with pytest.raises(ValueError, match="only with gloo"):
        groups.init_weight_group("127.0.0.1", 1, 0, 2, "g", 1.0, backend="nccl", streams=2)
    with pytest.raises(ValueError, match="gloo_streams=17"):
        DistributedTransport(gloo_streams=17)


def test_flat_pieces_are_one_run_per_stream_in_order() -> None:
    flat = torch.arange(10, dtype=torch.float32)
    assert [p.data_ptr() for p in groups.flat_pieces(flat, 1)] == [flat.data_ptr()]
    pieces = groups.flat_pieces(flat, 3)
    assert [p.numel() for p in pieces] == [4, 3, 3] and torch.equal(torch.cat(pieces), flat)
    assert all(p.untyped_storage().data_ptr() == flat.untyped_storage().data_ptr() for p in pieces)  # views
    assert [p.numel() for p in groups.flat_pieces(flat[:2], 4)] == [1, 1]  # no empty broadcasts


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank(rank: int, port: int, streams: int, out: str) -> None:
    torch.set_num_threads(1)
    pg = groups.init_weight_group("127.0.0.1", port, rank, 2, "test_group", 30.0, streams=streams)
    bucket = groups.interleave(_model_like_bucket(), streams)
    tensors = [torch.arange(math.prod(s["shape"]), dtype=torch.float32).reshape(s["shape"]) + i
               if rank == 0 else torch.empty(s["shape"]) for i, s in enumerate(bucket)]
    works = [dist.broadcast(t, src=0, group=pg, async_op=True) for t in tensors]
    for w in works:
        w.wait()
    if rank == 1:
        torch.save({s["name"]: t for s, t in zip(bucket, tensors)}, out)
    groups.destroy_weight_group(pg)


@pytest.mark.parametrize("streams", [1, 3])
def test_a_bucket_crosses_a_multi_stream_group_intact(streams: int, tmp_path) -> None:
    """Two real processes: per-tensor broadcasts over `streams` gloo connections, issued all
    at once (they complete in any order), arrive byte for byte."""
    out = tmp_path / "received.pt"
    mp.spawn(_rank, args=(_free_port(), streams, str(out)), nprocs=2)
    received = torch.load(out)
    for i, spec in enumerate(groups.interleave(_model_like_bucket(), streams)):
        expected = torch.arange(math.prod(spec["shape"]), dtype=torch.float32).reshape(spec["shape"]) + i
        assert torch.equal(received[spec["name"]], expected), spec["name"]


def _flat_rank(rank: int, port: int, streams: int, out: str) -> None:
    """Rank 0 sends a bucket of views into one buffer (a packed model), rank 1 receives into
    another laid out the same way: both sides pass spans, no staging copies."""
    torch.set_num_threads(1)
    pg = groups.init_weight_group("127.0.0.1", port, rank, 2, "test_flat", 30.0, streams=streams)
    specs = _model_like_bucket()
    total = sum(math.prod(s["shape"]) for s in specs)
    buf = torch.arange(total, dtype=torch.float32) if rank == 0 else torch.zeros(total)
    offs = [o // 4 for o in wire.offsets(specs)[0]]
    views = [buf[o:o + math.prod(s["shape"])].view(s["shape"]) for s, o in zip(specs, offs)]
    flat = wire.span(views)
    assert flat is not None and flat.data_ptr() == buf.data_ptr()
    for w in [dist.broadcast(p, src=0, group=pg, async_op=True) for p in groups.flat_pieces(flat, streams)]:
        w.wait()
    if rank == 1:
        torch.save({s["name"]: v for s, v in zip(specs, views)}, out)
    groups.destroy_weight_group(pg)


@pytest.mark.parametrize("streams", [1, 3])
def test_a_flattened_bucket_crosses_in_one_piece_per_stream_into_its_tensors(streams: int, tmp_path) -> None:
    out = tmp_path / "received.pt"
    mp.spawn(_flat_rank, args=(_free_port(), streams, str(out)), nprocs=2)
    received, pos = torch.load(out), 0
    for spec in _model_like_bucket():
        n = math.prod(spec["shape"])
        assert torch.equal(received[spec["name"]], torch.arange(pos, pos + n, dtype=torch.float32).view(spec["shape"]))
        pos += n
