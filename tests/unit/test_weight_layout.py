"""Weight layouts that let a flattened bucket travel with no copy: the trainer's packed
parameters (pack_parameters) and the engine's shadows laid out back to back
(WeightReceiver.shadow_span)."""

from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from milepost.core.engine.weight_receiver import WeightReceiver
from milepost.core.train.weight_sender import WeightSender, pack_parameters
from milepost.core.weight_sync import wire


def _model(seed: int = 0) -> Qwen2ForCausalLM:
    cfg = Qwen2Config(vocab_size=48, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
    torch.manual_seed(seed)
    return Qwen2ForCausalLM(cfg)


def _train(model: torch.nn.Module, steps: int = 2) -> list[float]:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ids = torch.arange(16).view(2, 8) % 48
    losses = []
    for _ in range(steps):
        loss = model(input_ids=ids, labels=ids).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    return losses


def test_packed_parameters_keep_values_ties_and_training() -> None:
    plain, packed = _model(), _model()
    before = {k: v.clone() for k, v in packed.state_dict().items()}
    params = list(packed.parameters())
    moved = pack_parameters(packed)
    assert moved == sum(p.numel() * 4 for p in params)
    assert list(packed.parameters()) == params  # the same Parameter objects
    assert packed.lm_head.weight is packed.model.embed_tokens.weight
    assert all(torch.equal(before[k], v) for k, v in packed.state_dict().items())
    assert _train(packed) == _train(plain)  # bit for bit: only the memory layout changed
    assert all(torch.equal(a, b) for a, b in zip(plain.state_dict().values(), packed.state_dict().values()))


def test_a_packed_bucket_is_one_span_of_the_parameters() -> None:
    model = _model()
    pack_parameters(model)
    sender = WeightSender(model)
    for bucket in sender.buckets(bucket_bytes=20_000):  # several buckets
        tensors = [t for _, t in sender._gather([s["name"] for s in bucket])]
        flat = wire.span(tensors)
        assert flat is not None and flat.data_ptr() == tensors[0].data_ptr()
        assert torch.equal(flat, torch.cat([t.reshape(-1) for t in tensors]))


def _receiver(model: torch.nn.Module) -> WeightReceiver:
    """The engine's receiver over a model, with the scheduler parts it touches."""
    sched = SimpleNamespace(model=model, model_lock=threading.Lock(), weight_version="0", num_running=lambda: 0,
                            memory=SimpleNamespace(update_problem=lambda: None))
    return WeightReceiver(sched, timeout_s=30)


def _specs(model: torch.nn.Module) -> list[wire.Spec]:
    return [b for bucket in WeightSender(model).buckets(1 << 30) for b in bucket]


def _push_span(receiver: WeightReceiver, specs: list[wire.Spec], value: float, version: str) -> torch.Tensor:
    assert receiver.begin("all")[0] == 200
    flat = receiver.shadow_span(specs)
    assert flat is not None
    flat.fill_(value)  # what the broadcast would write
    receiver.stage_version(version)
    assert receiver.end()[0] == 200
    return flat


def test_shadows_are_laid_out_once_then_live_weights_and_shadows_alternate() -> None:
    model = _model()
    receiver, specs = _receiver(model), _specs(model)
    first = _push_span(receiver, specs, 1.0, "1")  # new buffer; the loaded tensors become shadows
    assert model.model.embed_tokens.weight.data_ptr() == first.data_ptr()
    assert all(bool((p == 1.0).all()) for p in model.parameters())
    assert model.lm_head.weight is model.model.embed_tokens.weight
    second = _push_span(receiver, specs, 2.0, "2")  # those shadows are not one span: one more buffer
    assert second.data_ptr() != first.data_ptr()
    third = _push_span(receiver, specs, 3.0, "3")  # from here on the two buffers alternate
    assert third.data_ptr() == first.data_ptr()
    assert _push_span(receiver, specs, 4.0, "4").data_ptr() == second.data_ptr()
    assert all(bool((p == 4.0).all()) for p in model.parameters()) and receiver.sched.weight_version == "4"


def test_a_discarded_session_leaves_the_live_weights_alone() -> None:
    model = _model()
    receiver, specs = _receiver(model), _specs(model)
    _push_span(receiver, specs, 1.0, "1")
    assert receiver.begin("all")[0] == 200
    receiver.shadow_span(specs).fill_(9.0)
    assert receiver.end(abort=True)[0] == 200
    assert all(bool((p == 1.0).all()) for p in model.parameters()) and receiver.sched.weight_version == "1"


@pytest.mark.parametrize("change", [
    lambda specs: [{**s, "dtype": "bfloat16"} for s in specs],  # received as sent, converted after
    lambda specs: specs + specs[:1],  # a tensor twice
], ids=["other-dtype", "repeated"])
def test_no_span_when_the_bucket_cannot_be_received_in_place(change) -> None:
    model = _model()
    receiver = _receiver(model)
    assert receiver.begin("all")[0] == 200
    assert receiver.shadow_span(change(_specs(model))) is None
