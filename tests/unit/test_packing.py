"""Copies between packed layouts in few pieces (packing.CopyRuns), a memory resume's packed
allocation (packing.allocate_packed), and when the trainer keeps a CUDA bucket's plan
(cuda_sender.CudaBucketPlan.fits), and which buckets are read where they lie
(weight_sender.storage_groups, cuda_sender.packed_placement). CPU: the layouts and the bytes are the same on a GPU."""

from __future__ import annotations

import itertools

import torch

from milepost.core.train.cuda_sender import CudaBucketPlan, packed_placement, signature
from milepost.core.train.weight_sender import storage_groups
from milepost.core.weight_sync.packing import CopyRuns, allocate_packed

SHAPES = [(4, 3), (5,), (2, 2, 2), (7, 1)]


def _packed(shapes: list[tuple[int, ...]], dtype: torch.dtype = torch.float32) -> list[torch.Tensor]:
    buf = torch.empty(sum(torch.Size(s).numel() for s in shapes), dtype=dtype)
    out, pos = [], 0
    for s in shapes:
        n = torch.Size(s).numel()
        out.append(buf[pos:pos + n].view(s))
        pos += n
    return out


def _sources(shapes: list[tuple[int, ...]]) -> list[torch.Tensor]:
    torch.manual_seed(0)
    sources = _packed(shapes)
    for t in sources:
        t.copy_(torch.randn(t.shape))
    return sources


def test_back_to_back_on_both_sides_is_one_copy() -> None:
    targets, sources = _packed(SHAPES), _sources(SHAPES)
    runs = CopyRuns(targets, sources)
    assert runs.num_copies == 1
    runs.run()
    assert all(torch.equal(t, s) for t, s in zip(targets, sources))


def test_a_break_in_either_layout_splits_the_runs_and_every_tensor_is_still_copied() -> None:
    sources = _sources(SHAPES)
    targets = _packed(SHAPES[:2]) + [torch.empty(SHAPES[2])] + _packed(SHAPES[3:])  # one target on its own
    runs = CopyRuns(targets, sources)
    assert len(runs.spans) == 1 and runs.num_copies == 2  # the first two as a span; the rest one by one
    runs.run()
    assert all(torch.equal(t, s) for t, s in zip(targets, sources))
    reordered = [sources[1], sources[0], sources[2], sources[3]]  # back to back, but not in the targets' order
    targets = _packed([tuple(t.shape) for t in reordered])
    runs = CopyRuns(targets, reordered)
    assert runs.num_copies == 2  # the last three follow each other on both sides
    runs.run()
    assert all(torch.equal(t, s) for t, s in zip(targets, reordered))


def test_another_dtype_is_converted_not_copied_as_bytes() -> None:
    sources = _sources(SHAPES)
    targets = _packed(SHAPES, torch.bfloat16)
    runs = CopyRuns(targets, sources)
    assert not runs.spans
    runs.run()
    assert all(torch.equal(t, s.to(torch.bfloat16)) for t, s in zip(targets, sources))


def test_a_resumed_allocation_lies_back_to_back_per_dtype() -> None:
    lives = [torch.nn.Parameter(torch.empty(0), requires_grad=False) for _ in range(3)]
    lives.append(torch.nn.Parameter(torch.empty(0, dtype=torch.int8), requires_grad=False))
    wanted = [(torch.Size([3, 2]), torch.float32), (torch.Size([4]), torch.float32),
              (torch.Size([2, 2]), torch.float32), (torch.Size([5]), torch.int8)]
    allocate_packed([(t, shape, dtype) for t, (shape, dtype) in zip(lives, wanted)])
    assert [(t.shape, t.dtype) for t in lives] == wanted
    floats = lives[:3]
    assert all(b.data_ptr() == a.data_ptr() + a.numel() * 4 for a, b in itertools.pairwise(floats))
    assert CopyRuns(floats, _sources([(3, 2), (4,), (2, 2)])).num_copies == 1


def test_a_cuda_bucket_plan_is_kept_only_for_the_same_tensors_names_and_buffer() -> None:
    tensors, buffer = _sources(SHAPES), torch.empty(100, dtype=torch.uint8)
    names = ["a", "b", "c", "d"]
    copied = CudaBucketPlan(tuple(names), False, buffer, [], signature(tensors))
    assert copied.fits(names, tensors, buffer)
    assert not copied.fits(names, tensors, torch.empty(100, dtype=torch.uint8))  # the buffer was replaced
    assert not copied.fits(names[::-1], tensors[::-1], buffer)  # another order
    moved = [*tensors[:3], tensors[3].clone()]  # one tensor at a new address (its .data reassigned)
    assert not copied.fits(names, moved, buffer)
    reshaped = [*tensors[:3], tensors[3].view(1, 7)]  # same address, another shape
    assert not copied.fits(names, reshaped, buffer)
    in_place = CudaBucketPlan(tuple(names), True, tensors[0], [], signature(tensors))
    assert in_place.fits(names, tensors, None)  # read where the weights lie: no buffer involved


def test_a_kept_plan_fills_its_buffer_with_the_tensors_current_values() -> None:
    """The concatenation's views are made at the first fill and kept with the plan: a later
    push of the same tensors, changed in place by a train step, sends their new bytes."""
    from milepost.core.train.cuda_sender import CudaSender
    from milepost.core.weight_sync import wire
    tensors = [torch.randn(s).to(torch.bfloat16) for s in SHAPES]  # separate tensors: copied, not read in place
    specs = [{"name": n, "dtype": "bfloat16", "shape": list(t.shape)} for n, t in zip("abcd", tensors)]
    offsets, total = wire.offsets(specs)
    plan = CudaBucketPlan(tuple("abcd"), False, torch.zeros(total, dtype=torch.uint8),
                          [{**s, "offset": o} for s, o in zip(specs, offsets)], signature(tensors))
    for _ in range(3):
        CudaSender._fill(plan, tensors)
        assert plan.concatenation is not None
        assert all(torch.equal(wire.view(plan.flat, s["offset"], s), t) for s, t in zip(plan.placed, tensors))
        for t in tensors:
            t.mul_(-2)  # the train step writes in place: same addresses, the plan still fits


def test_tensors_sharing_a_storage_are_bucketed_together_in_the_order_they_lie_in_it() -> None:
    """Megatron's staged views: its parameter buffer in megatron's order (here reversed), q/k/v
    in a buffer of their own, and tensors of a storage each keep their order."""
    params = _packed(SHAPES)[::-1]  # lie in reverse of the sent order
    qkv = _packed([(3,), (2,)])
    alone = [torch.zeros(2), torch.zeros(3)]
    layout = [("p0", params[0]), ("a0", alone[0]), ("q", qkv[0]), ("p1", params[1]), ("k", qkv[1]),
              ("p2", params[2]), ("a1", alone[1]), ("p3", params[3]), ("meta", torch.empty(4, device="meta"))]
    groups = [[n for n, _ in g] for g in storage_groups(layout)]
    assert groups == [["p3", "p2", "p1", "p0"], ["a0", "a1", "meta"], ["q", "k"]]
    packed = list(zip("wxyz", _packed(SHAPES)))  # packed in the sent order (the torch backend): unchanged
    assert [[n for n, _ in g] for g in storage_groups(packed)] == [list("wxyz")]


def test_a_bucket_is_read_in_place_where_its_tensors_share_one_storage_at_any_offsets() -> None:
    reversed_params = _packed(SHAPES)[::-1]
    pairs = [({"name": str(i), "dtype": "float32", "shape": list(t.shape)}, t) for i, t in enumerate(reversed_params)]
    flat, placed = packed_placement(pairs)  # type: ignore[misc]
    assert flat.untyped_storage().data_ptr() == reversed_params[0].untyped_storage().data_ptr()
    assert [p["offset"] for p in placed] == [t.storage_offset() * 4 for t in reversed_params]
    assert packed_placement(pairs[:2] + [(pairs[2][0], pairs[2][1].clone())]) is None  # another storage
    wide = torch.zeros(4, 4)
    assert packed_placement([({"name": "col", "dtype": "float32", "shape": [4, 2]}, wide[:, :2])]) is None
