"""precision.train in the trainers (core/train/precision.py): int4_qat's forward is the model
with int4-dequantised weights bit for bit, with straight-through gradients into fp32 master
weights; bf16 is autocast over fp32 parameters (torch backend; megatron on CPU), so the master
weights and Adam's state stay fp32; the engine logprob gap is reported as a per-token mean."""

from __future__ import annotations

import copy
import multiprocessing as mp

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from milepost.core.config import AlgoConfig, TrainConfig
from milepost.core.quant.int4 import fake_quantize_int4, quantized_linears
from milepost.core.train.precision import Int4QatLinear, attach_int4_qat, autocast, prepare_model
from milepost.core.train.torch_backend import engine_gap_mean
from milepost.core.types import Sample


def _tiny(seed: int = 0) -> Qwen2ForCausalLM:
    torch.manual_seed(seed)
    cfg = Qwen2Config(vocab_size=40, hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, tie_word_embeddings=True, eos_token_id=1, pad_token_id=0)
    return Qwen2ForCausalLM(cfg).float().eval()


IDS = torch.randint(2, 40, (3, 11), generator=torch.Generator().manual_seed(1))


def test_int4_qat_forward_is_the_model_with_fake_quantised_weights_bit_for_bit() -> None:
    model = _tiny()
    reference = copy.deepcopy(model)
    with torch.no_grad():
        for layer in quantized_linears(reference).values():
            layer.weight.copy_(fake_quantize_int4(layer.weight))
    names = attach_int4_qat(model)
    assert len(names) == 14 and all(isinstance(m, Int4QatLinear) for m in quantized_linears(model).values())
    with torch.no_grad():
        assert torch.equal(model(input_ids=IDS).logits, reference(input_ids=IDS).logits)
        assert not torch.equal(model(input_ids=IDS).logits, _tiny()(input_ids=IDS).logits)  # quantisation matters


def test_int4_qat_keeps_parameters_and_sends_straight_through_gradients_to_the_fp32_master_weights() -> None:
    model = _tiny()
    before = {n: p for n, p in model.named_parameters()}
    reference = copy.deepcopy(model)
    prepare_model(model, "int4_qat")
    assert {n: p for n, p in model.named_parameters()} == before  # same names, same Parameter objects
    fq = {n: fake_quantize_int4(m.weight).detach() for n, m in quantized_linears(reference).items()}
    for n, m in quantized_linears(reference).items():  # the reference computes with the fake-quantised weights
        m.weight = torch.nn.Parameter(fq[n].clone())
    model(input_ids=IDS).logits.square().mean().backward()
    reference(input_ids=IDS).logits.square().mean().backward()
    for n, m in quantized_linears(model).items():
        expected = quantized_linears(reference)[n].weight.grad
        assert m.weight.dtype == torch.float32 and torch.equal(m.weight.grad, expected)


def test_bf16_autocast_computes_in_bf16_over_fp32_parameters() -> None:
    model = prepare_model(_tiny(), "bf16")
    with torch.no_grad():
        full = model(input_ids=IDS).logits
        with autocast("bf16"):
            half = model(input_ids=IDS).logits
    assert half.dtype == torch.bfloat16 and not torch.equal(half.float(), full)
    assert float((half.float() - full).abs().max()) < 0.1
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    with pytest.raises(ValueError, match="precision.train fp8 is not built for the torch backend"):
        prepare_model(_tiny(), "fp8")


def _samples() -> list[Sample]:
    return [Sample(prompt_index=i, group_index=0, prompt_ids=[3, 4, 5 + i], response_ids=[6, 7, 8],
                    engine_logprobs=[-3.0, -3.5, -4.0], loss_mask=[1, 1, 1], finish_reason="stop",
                    weight_version="0", label="", reward=float(i), advantage=1.0 if i else -1.0) for i in range(2)]


@pytest.mark.parametrize("precision", ["bf16", "int4_qat"])
def test_a_torch_rank_trains_with_fp32_master_weights_and_adam_state(tmp_path, precision: str) -> None:
    from milepost.core.train.torch_backend import RankWorker
    path = str(tmp_path / "m")
    _tiny().save_pretrained(path)
    worker = RankWorker(0, 1, path, TrainConfig(num_ranks=1, lr=1e-2), AlgoConfig(), 1.0, seed=3, total_steps=None,
                        precision=precision)
    worker.setup(worker.free_port())
    try:
        before = {k: v.clone() for k, v in worker.module.state_dict().items()}
        metrics = worker.train(_samples(), n_micro=1, normalizer=6.0)
        after = worker.module.state_dict()
        assert metrics["train/skipped_nonfinite"] == 0.0 and set(after) == set(before)
        assert {t.dtype for t in after.values()} == {torch.float32}
        assert any(not torch.equal(before[k], after[k]) for k in before)  # it trained
        states = [s for s in worker.optimizer.state.values()]
        assert states and {s["exp_avg"].dtype for s in states} == {torch.float32}
        assert metrics["train/engine_logprob_absdiff_sum"] >= metrics["train/engine_logprob_diff_max"] > 0
    finally:
        worker.shutdown()


def test_the_engine_gap_becomes_a_mean_per_loss_token() -> None:
    got = engine_gap_mean({"train/engine_logprob_absdiff_sum": 3.0, "train/engine_logprob_diff_max": 1.0}, 6)
    assert got == {"train/engine_logprob_diff_mean": 0.5, "train/engine_logprob_diff_max": 1.0}
    assert engine_gap_mean({"train/loss": 1.0}, 0) == {"train/loss": 1.0}


def _megatron_bf16(path: str, queue: mp.Queue) -> None:
    from milepost.core.train.megatron.worker import MegatronRankWorker
    torch.set_num_threads(1)
    worker = MegatronRankWorker(0, 1, path, TrainConfig(backend="megatron", num_ranks=1, micro_batch_size=2, lr=1e-3),
                                AlgoConfig(), temperature=1.0, seed=0, total_steps=None, precision="bf16")
    worker.setup(worker.free_port())
    half = worker.logprobs(_samples())
    worker.autocast = "fp32"
    full = worker.logprobs(_samples())
    worker.autocast = "bf16"
    result = worker.train(_samples(), 6.0)
    dtypes = {p.dtype for c in worker.model for p in c.parameters()}
    queue.put({"gap": max(abs(a - b) for x, y in zip(half, full) for a, b in zip(x, y)), "dtypes": str(dtypes),
               "skipped": result["skipped_nonfinite"], "grad_norm": result["grad_norm"]})


def test_megatron_bf16_on_cpu_is_autocast_over_fp32_parameters(tmp_path) -> None:
    path = str(tmp_path / "m")
    _tiny().save_pretrained(path)
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=_megatron_bf16, args=(path, queue))
    proc.start()
    result = queue.get(timeout=240)
    proc.join(timeout=60)
    assert result["dtypes"] == "{torch.float32}" and result["skipped"] == 0.0 and result["grad_norm"] > 0
    assert 0 < result["gap"] < 0.1  # bf16 matmuls: close to, and not equal to, fp32
