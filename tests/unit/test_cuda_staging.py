"""The engine's reading of milepost's CUDA payloads (core/engine/cuda_staging.py) on CPU: a
real WeightReceiver session and the real route function, with the trainer's storage "mapped"
by hand (CUDA IPC needs a GPU: tests/gpu/test_cuda_buffers_gpu.py maps real ones). What runs
here is what the cache decides: a payload read once, its plan reused while its shadows stand,
made again when they moved, dropped when stale or on a memory release."""

from __future__ import annotations

import base64
import itertools
import threading
from types import SimpleNamespace

import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from milepost.core.engine.cuda_staging import CudaStaging
from milepost.core.engine.weight_receiver import WeightReceiver
from milepost.core.engine.weight_routes import load_tensor_payload
from milepost.core.train.weight_sender import WeightSender
from milepost.core.weight_sync import cuda_buffers, wire


def _model(seed: int) -> Qwen2ForCausalLM:
    cfg = Qwen2Config(vocab_size=48, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
    torch.manual_seed(seed)
    return Qwen2ForCausalLM(cfg).eval()


class HandMapped:
    """Stands in for MappedStorages where no GPU can map: a storage by its export's handle
    (`storages`, what the trainers exported), "mapped" at its first read and kept by the same
    rule (sweep unmaps what was not read since new_push)."""

    def __init__(self) -> None:
        self.storages: dict[bytes, torch.Tensor] = {}
        self.mapped: set[bytes] = set()
        self.used: set[bytes] = set()

    def storage(self, descriptor: dict) -> torch.Tensor:
        handle = descriptor["storage"]["handle"]
        self.mapped.add(handle)
        self.used.add(handle)
        return self.storages[handle]

    def new_push(self) -> None:
        self.used.clear()

    def sweep(self) -> int:
        stale = self.mapped - self.used
        self.mapped -= stale
        return len(stale)

    def __len__(self) -> int:
        return len(self.mapped)


def _receiver(model: torch.nn.Module) -> tuple[WeightReceiver, HandMapped]:
    sched = SimpleNamespace(model=model, model_lock=threading.Lock(), weight_version="0", num_running=lambda: 0,
                            memory=SimpleNamespace(update_problem=lambda: None))
    receiver = WeightReceiver(sched, timeout_s=30)
    receiver.cuda = CudaStaging(receiver, device_type="cpu")
    mapped = HandMapped()
    receiver.cuda.mapped = mapped  # type: ignore[assignment]
    return receiver, mapped


def _payloads(trainer: torch.nn.Module, mapped: HandMapped, bucket_bytes: int, handle: bytes,
              reversed_with_gaps: bool = False, sent_reversed: bool = False) -> list[str]:
    """The trainer's weights in one flat storage per push (a bucket buffer), described as
    WeightSender.to_cuda describes them: one descriptor per bucket. `reversed_with_gaps`: the
    storage holds them in reverse order with 64 bytes between (as megatron-core's DDP buffer
    holds Megatron's parameters, which its push reads in place). `sent_reversed`: the buckets
    name the tensors in reverse of the model's order (a trainer whose storage is in another
    order than the engine's: Megatron's), back to back in the storage in that order."""
    sender = WeightSender(trainer)
    buckets = (wire.plan_buckets(sender.named_tensors()[::-1], bucket_bytes) if sent_reversed
               else sender.buckets(bucket_bytes))
    specs = [s for b in buckets for s in b]
    offsets, total = wire.offsets(specs)
    if reversed_with_gaps:
        offsets, total = [], 0
        for spec in reversed(specs):
            offsets.insert(0, total)
            total += wire.spec_nbytes(spec) + 64
    flat = torch.empty(total, dtype=torch.uint8)
    named = dict(sender.named_tensors())
    for spec, offset in zip(specs, offsets):
        wire.view(flat, offset, spec).copy_(named[spec["name"]])
    mapped.storages[handle] = flat
    export = {"device": "GPU-test", "handle": base64.b64encode(handle).decode(), "size_bytes": total,
              "offset_bytes": 0, "ref_counter_handle": base64.b64encode(b"rc").decode(), "ref_counter_offset": 0,
              "event_handle": None, "event_sync_required": False}
    at = dict(zip((s["name"] for s in specs), offsets))
    return [cuda_buffers.encode_descriptor(export, [{**s, "offset": at[s["name"]]} for s in bucket])
            for bucket in buckets]


def _load(receiver: WeightReceiver, payloads: list[str]) -> list[str]:
    replies = []
    for payload in payloads:
        status, text = receiver.run_update(lambda p=payload: load_tensor_payload(receiver, p), False, None)
        assert status == 200, text
        replies.append(text)
    return replies


def _push(receiver: WeightReceiver, payloads: list[str], version: str) -> list[str]:
    assert receiver.begin("")[0] == 200
    replies = _load(receiver, payloads)
    receiver.stage_version(version)
    assert receiver.end()[0] == 200
    return replies


def test_a_payload_is_planned_once_and_reused_while_its_shadows_stand() -> None:
    engine, trainer = _model(0), _model(1)
    receiver, mapped = _receiver(engine)
    payloads = _payloads(trainer, mapped, 4096, b"bucket-buffer")
    assert len(payloads) > 2
    assert receiver.begin("")[0] == 200
    assert all(r.endswith("planned)") for r in _load(receiver, payloads))
    assert all(receiver.cuda.knows(p) for p in payloads)
    assert receiver.end(abort=True)[0] == 200  # the shadows stay the receiver's
    replies = _push(receiver, payloads, "1")
    assert all("copied as one span; plan reused" in r for r in replies)
    assert all(torch.equal(a, b) for a, b in zip(engine.state_dict().values(), trainer.state_dict().values()))
    assert receiver.sched.weight_version == "1"


def test_after_a_swapping_commit_the_plans_are_made_again_and_serve_the_new_bytes() -> None:
    """On CPU a commit swaps the shadows in (on a GPU it copies them in, and plans stand): the
    plans then name tensors that are live, so the next push plans again."""
    engine, trainer = _model(0), _model(1)
    receiver, mapped = _receiver(engine)
    payloads = _payloads(trainer, mapped, 4096, b"bucket-buffer")
    _push(receiver, payloads, "1")
    with torch.no_grad():
        for p in trainer.parameters():
            p.mul_(-1)
    again = _payloads(trainer, mapped, 4096, b"bucket-buffer")  # the same buffer rewritten: the same strings
    assert again == payloads
    assert all(r.endswith("planned)") for r in _push(receiver, again, "2"))
    assert all(torch.equal(a, b) for a, b in zip(engine.state_dict().values(), trainer.state_dict().values()))


def test_a_new_layout_drops_the_plans_it_made_stale_and_a_memory_release_drops_all() -> None:
    engine, trainer = _model(0), _model(1)
    receiver, mapped = _receiver(engine)
    small = _payloads(trainer, mapped, 4096, b"small-buckets")
    assert receiver.begin("")[0] == 200
    _load(receiver, small)
    whole = _payloads(trainer, mapped, 1 << 30, b"one-bucket")  # every tensor in one bucket: shadows re-laid
    _load(receiver, whole)
    assert receiver.cuda.has_plan(whole[0]) and not any(receiver.cuda.has_plan(p) for p in small)
    assert receiver.end(abort=True)[0] == 200
    assert not isinstance(receiver.drop_weights(), str)
    assert not receiver.cuda.has_plan(whole[0])
    assert receiver.cuda.knows(whole[0])  # its checked descriptor (data, no memory) is kept


def _resume_unloaded(receiver: WeightReceiver) -> None:
    """A memory release and resume of the weights, as colocated placement makes before each push."""
    shapes = receiver.drop_weights()
    assert not isinstance(shapes, str), shapes
    receiver.allocate_weights(shapes)
    assert receiver.unloaded


def _same(engine: torch.nn.Module, trainer: torch.nn.Module) -> bool:
    return all(torch.equal(a, b) for a, b in zip(engine.state_dict().values(), trainer.state_dict().values()))


def test_a_push_after_a_memory_resume_is_received_in_place_and_keeps_no_shadow() -> None:
    engine, trainer = _model(0), _model(1)
    receiver, mapped = _receiver(engine)
    payloads = _payloads(trainer, mapped, 4096, b"bucket-buffer")
    _push(receiver, payloads, "1")
    _resume_unloaded(receiver)
    names = list(receiver.target_map())
    assert receiver.begin("")[0] == 200
    _load(receiver, payloads)
    assert _same(engine, trainer)  # the bytes went straight into the live tensors
    assert receiver.unloaded  # ... which serve nothing before the commit
    receiver.stage_version("2")
    generation = receiver.generation
    assert receiver.end() == (200, f"committed {len(receiver.target_map()) - 1} tensors as weight_version 2")
    assert not receiver.unloaded and receiver.generation > generation
    assert all(receiver.shadow_of(n) is None for n in names)  # one copy of the weights: no shadow held
    assert _same(engine, trainer)


def test_a_failed_push_into_unloaded_weights_leaves_them_unloaded() -> None:
    engine, trainer = _model(0), _model(1)
    receiver, mapped = _receiver(engine)
    payloads = _payloads(trainer, mapped, 4096, b"bucket-buffer")
    _resume_unloaded(receiver)
    everything = set(receiver.unloaded)
    assert receiver.begin("")[0] == 200
    _load(receiver, payloads[:1])
    receiver.stage_version("1")
    assert receiver.end(abort=True)[0] == 200
    assert receiver.unloaded == everything  # the engine still refuses to serve (memory.serving_problem)
    assert receiver.sched.weight_version == "0"
    _push(receiver, payloads, "1")
    assert not receiver.unloaded and _same(engine, trainer)


def test_a_push_into_loaded_weights_after_an_in_place_one_stages_privately_again() -> None:
    """Received in place only while unloaded: the next push must not touch what is served."""
    engine, trainer = _model(0), _model(1)
    receiver, mapped = _receiver(engine)
    payloads = _payloads(trainer, mapped, 4096, b"bucket-buffer")
    _resume_unloaded(receiver)
    _push(receiver, payloads, "1")
    served = {k: v.clone() for k, v in engine.state_dict().items()}
    with torch.no_grad():
        for p in trainer.parameters():
            p.mul_(-1)
    again = _payloads(trainer, mapped, 4096, b"bucket-buffer")
    assert receiver.begin("")[0] == 200
    assert all(r.endswith("planned)") for r in _load(receiver, again))  # the in-place plans went with the commit
    assert all(torch.equal(served[k], v) for k, v in engine.state_dict().items())
    assert receiver.end(abort=True)[0] == 200
    _push(receiver, again, "2")
    assert _same(engine, trainer)


def test_sglang_flattened_buckets_are_received_in_place_too() -> None:
    """The same rule for SGLang's flattened bucket (Staging.load_flat), copied into the
    unloaded live tensors; a private tensor staged before for one of them is dropped."""
    engine, trainer = _model(0), _model(1)
    receiver, _ = _receiver(engine)
    _resume_unloaded(receiver)
    sender = WeightSender(trainer)
    specs = [s for bucket in sender.buckets(1 << 30) for s in bucket]
    offsets, total = wire.offsets(specs)
    flat = torch.empty(total, dtype=torch.uint8)
    named = dict(sender.named_tensors())
    for spec, offset in zip(specs, offsets):
        wire.view(flat, offset, spec).copy_(named[spec["name"]])
    placed = [{**s, "offset": o} for s, o in zip(specs, offsets)]
    assert receiver.begin("")[0] == 200
    receiver.shadow(specs[0]["name"]).fill_(7.0)  # staged privately first: the in-place bytes are newer
    assert receiver.run_update(lambda: receiver.load_flat(flat, placed), False, "1")[0] == 200
    assert receiver.end()[0] == 200
    assert not receiver.unloaded and _same(engine, trainer)
    assert all(receiver.shadow_of(s["name"]) is None for s in specs[1:])


def test_the_commit_plan_is_kept_for_the_same_shadows_and_made_again_when_they_change(monkeypatch) -> None:
    """On a GPU a commit copies the shadows into the live weights (CUDA graphs keep their
    addresses); here the receiver is told to, on CPU. Its span copies are planned once while
    the same shadows go into the same live tensors, and again after shadows are re-laid or the
    weights are released: each commit still serves the trainer's bytes."""
    import milepost.core.engine.weight_receiver as weight_receiver
    made = []

    class CountedRuns(weight_receiver.CopyRuns):
        def __init__(self, *args, **kwargs) -> None:
            made.append(1)
            super().__init__(*args, **kwargs)
    monkeypatch.setattr(weight_receiver, "CopyRuns", CountedRuns)
    monkeypatch.setattr(WeightReceiver, "_copies_in", staticmethod(lambda live, tensor, lease: lease is None))
    engine, trainer = _model(0), _model(1)
    receiver, mapped = _receiver(engine)
    small = _payloads(trainer, mapped, 4096, b"small")
    for version in ("1", "2", "3"):
        _push(receiver, small, version)
        assert _same(engine, trainer)
    assert len(made) == 1  # planned at the first commit, kept for the next two
    with torch.no_grad():
        for p in trainer.parameters():
            p.mul_(-1)
    whole = _payloads(trainer, mapped, 1 << 30, b"whole")  # one bucket: the shadows are re-laid
    _push(receiver, whole, "4")
    assert len(made) == 2 and _same(engine, trainer)
    _resume_unloaded(receiver)
    _push(receiver, whole, "5")  # in place: nothing to copy, an empty plan
    _push(receiver, whole, "6")  # served again: shadows made anew
    assert _same(engine, trainer) and len(made) == 4


def test_a_bucket_scattered_in_the_trainers_storage_is_received_in_place_tensor_by_tensor() -> None:
    """Megatron's staged views lie in its parameter buffer in megatron's order, not the
    bucket's: a released push still writes straight into the live weights, each tensor from
    its own offset; a served push stages them privately as before."""
    engine, trainer = _model(0), _model(1)
    receiver, mapped = _receiver(engine)
    payloads = _payloads(trainer, mapped, 4096, b"ddp-buffer", reversed_with_gaps=True)
    served = _push(receiver, payloads, "1")
    several = [i for i, r in enumerate(served) if not r.startswith("staged 1 ")]  # buckets of 2+ tensors
    assert several and all("tensor by tensor" in served[i] for i in several) and _same(engine, trainer)
    with torch.no_grad():
        for p in trainer.parameters():
            p.mul_(-1)
    _payloads(trainer, mapped, 4096, b"ddp-buffer", reversed_with_gaps=True)  # the trainer's step
    _resume_unloaded(receiver)
    names = list(receiver.target_map())
    assert receiver.begin("")[0] == 200
    replies = _load(receiver, payloads)
    assert all("in place" in r for r in replies) and all("tensor by tensor" in replies[i] for i in several)
    receiver.stage_version("2")
    assert receiver.end()[0] == 200
    assert all(receiver.shadow_of(n) is None for n in names) and _same(engine, trainer)


def test_a_resume_lays_the_weights_out_in_the_last_pushs_order_so_the_next_push_copies_spans() -> None:
    """The trainer sends in another order than the model's: a served push stages into shadows
    laid out in the sent order (one span a bucket); after a release and resume the weights lie
    in the order of the last push of every tensor (not of a later push of a few), so the push
    into them is one span a bucket, not a copy per tensor."""
    engine, trainer = _model(0), _model(1)
    receiver, mapped = _receiver(engine)
    payloads = _payloads(trainer, mapped, 4096, b"megatron-order", sent_reversed=True)
    several = [i for i, p in enumerate(payloads) if len(receiver.cuda._descriptor(p, None)[0]["tensors"]) > 1]
    assert several
    assert all("as one span" in r for r in _push(receiver, payloads, "1"))
    _push(receiver, _payloads(trainer, mapped, 4096, b"model-order")[:2], "1b")  # a subset: its order is not kept
    _resume_unloaded(receiver)
    assert receiver.begin("")[0] == 200
    replies = _load(receiver, payloads)
    receiver.stage_version("2")
    assert receiver.end()[0] == 200
    assert all("in place" in r and "as one span" in r for r in replies), replies
    assert _same(engine, trainer)
    targets = receiver.target_map()
    lives = [live.data for name, (canonical, live) in targets.items() if name == canonical]
    assert not wire.adjacent(lives[0], lives[1])  # no longer in the model's order ...
    assert all(wire.adjacent(later, earlier) for earlier, later in itertools.pairwise(lives))  # ... but the sent one


def test_a_whole_push_unmaps_the_trainer_storages_it_did_not_read() -> None:
    """A restarted trainer exports new storages; its first push (its stage serves the checkpoint
    before any rollout) is a whole push, and its commit lets go of the dead trainer's mappings.
    A push of a few tensors reads a few storages and unmaps nothing."""
    engine, trainer = _model(0), _model(1)
    receiver, mapped = _receiver(engine)
    _push(receiver, _payloads(trainer, mapped, 1 << 30, b"dead-trainer"), "1")
    assert mapped.mapped == {b"dead-trainer"}
    restarted = _payloads(trainer, mapped, 1 << 30, b"restarted-trainer")
    _push(receiver, restarted, "2")
    assert mapped.mapped == {b"restarted-trainer"}
    _push(receiver, _payloads(trainer, mapped, 4096, b"a-few")[:1], "3")
    assert mapped.mapped == {b"restarted-trainer", b"a-few"} and _same(engine, trainer)
