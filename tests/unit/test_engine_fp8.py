"""precision.rollout fp8 (issue 21): the built-in engine stores block-wise fp8 weights
(core/engine/quantized.py), the trainer's weight sender sends that format (quantised on sync,
core/train/weight_sender.py), both pick the same tensors by one rule (core/quant/fp8.py
`served_in_fp8`), and a disk load of the trainer's unquantised export is served exactly as a
push of the same weights. The pushes through a real engine process:
tests/integration/test_fp8_serving.py."""

from __future__ import annotations

import re
from types import SimpleNamespace

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from milepost.core.config import RolloutConfig
from milepost.core.engine.quantized import Fp8Linear, fp8_linears, load_model, serve_fp8, served_rows, served_state
from milepost.core.engine.scheduler import Scheduler
from milepost.core.engine.server import parse_args
from milepost.core.engine.weight_receiver import WeightReceiver
from milepost.core.fleet.launcher import engine_command
from milepost.core.quant.fp8 import (
    FP8_DTYPE,
    dequantize_fp8_blockwise,
    quantize_fp8_blockwise,
    scale_name,
    served_in_fp8,
)
from milepost.core.train.weight_sender import WeightSender

IDS = torch.randint(2, 40, (2, 9), generator=torch.Generator().manual_seed(0))


def _tiny(seed: int) -> Qwen2ForCausalLM:
    """hidden 128 (one block), intermediate 320 (gate/up: 3 row blocks, the last ragged; down:
    3 column blocks), untied head (so lm_head.weight is a tensor of its own)."""
    torch.manual_seed(seed)
    cfg = Qwen2Config(vocab_size=40, hidden_size=128, intermediate_size=320, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, tie_word_embeddings=False, eos_token_id=1, pad_token_id=0)
    return Qwen2ForCausalLM(cfg).float().eval()


@pytest.mark.parametrize("name,shape,picked", [
    ("model.layers.0.self_attn.q_proj.weight", (128, 128), True),
    ("model.layers.11.mlp.down_proj.weight", (128, 320), True),
    ("model.layers.3.mlp.experts.7.gate_proj.weight", (64, 128), True),  # an expert's Linear
    ("model.layers.3.mlp.gate.weight", (8, 128), False),  # the MoE router picks experts
    ("model.layers.3.mlp.shared_expert_gate.weight", (1, 128), False),  # Qwen2-MoE: SGLang keeps it unquantised
    ("model.layers.3.mlp.shared_expert.up_proj.weight", (256, 128), True),
    ("model.layers.0.self_attn.q_proj.bias", (128,), False),
    ("model.layers.0.input_layernorm.weight", (128,), False),
    ("model.embed_tokens.weight", (40, 128), False),
    ("lm_head.weight", (40, 128), False),
])
def test_one_rule_by_name_picks_the_decoder_linears_and_leaves_embeddings_head_norms_and_routers(
        name, shape, picked) -> None:
    assert served_in_fp8(name, shape) is picked


def test_fp8_serving_stores_e4m3_weights_and_block_scales_and_computes_with_their_dequantised_values() -> None:
    engine, reference = _tiny(0), _tiny(0)
    expected = {name: quantize_fp8_blockwise(layer.weight) for name, layer in fp8_linears(reference).items()}
    names = serve_fp8(engine, torch.bfloat16)
    assert names == sorted(expected) and len(names) == 14
    state = engine.state_dict()
    for name, (q, scale) in expected.items():
        assert isinstance(engine.get_submodule(name), Fp8Linear)
        assert state[f"{name}.weight"].dtype == FP8_DTYPE and torch.equal(state[f"{name}.weight"].float(), q.float())
        assert torch.equal(state[scale_name(f"{name}.weight")], scale)
        # the matmuls' weight: the reference's, with each Linear's weight dequantised to bf16
        reference.get_submodule(name).weight.data = dequantize_fp8_blockwise(q, scale)
    assert state["model.layers.0.mlp.up_proj.weight_scale_inv"].shape == (3, 1)  # 320 rows: 128 + 128 + ragged 64
    assert state["model.layers.0.mlp.down_proj.weight_scale_inv"].shape == (1, 3)
    assert state["lm_head.weight"].dtype == state["model.norm.weight"].dtype == torch.bfloat16
    reference.to(torch.bfloat16)
    with torch.no_grad():
        assert torch.equal(engine(input_ids=IDS).logits, reference(input_ids=IDS).logits)
    served = torch.tensor(served_rows(engine, "model.layers.1.mlp.down_proj.weight", 10**6))
    assert torch.equal(served, dequantize_fp8_blockwise(*expected["model.layers.1.mlp.down_proj"]))


def test_the_sender_sends_the_engines_format_quantised_from_the_live_weights_in_few_one_dtype_buckets() -> None:
    trainer, engine = _tiny(0), _tiny(1)
    serve_fp8(engine, torch.bfloat16)
    sender = WeightSender(trainer, copy_threads=1, weight_format="fp8")
    buckets = sender.buckets(1 << 30)
    assert [b[0]["dtype"] for b in buckets] == ["float32", "float8_e4m3fn", "float32"]  # rest, weights, scales
    sent = [s for b in buckets for s in b]
    assert {s["name"] for s in sent} == set(engine.state_dict())  # exactly what the fp8 engine holds
    assert all(list(s["shape"]) == list(engine.state_dict()[s["name"]].shape) for s in sent)
    pairs = dict((spec["name"], t) for spec, t in sender._gather([s["name"] for s in sent]))
    for name, layer in fp8_linears(trainer).items():
        q, scale = quantize_fp8_blockwise(layer.weight)
        assert torch.equal(pairs[f"{name}.weight"].float(), q.float())
        assert torch.equal(pairs[scale_name(f"{name}.weight")], scale)
    # quantised at send time: a changed weight is sent changed
    trainer.model.layers[0].self_attn.o_proj.weight.data.mul_(3)
    (_, again), = sender._gather(["model.layers.0.self_attn.o_proj.weight_scale_inv"])
    assert torch.allclose(again, 3 * pairs["model.layers.0.self_attn.o_proj.weight_scale_inv"])
    plain = WeightSender(trainer, copy_threads=1)  # no format: the tensors as they are
    assert [s["name"] for b in plain.buckets(1 << 30) for s in b] == list(trainer.state_dict())


def test_a_disk_load_of_an_unquantised_export_is_served_as_that_export_pushed(tmp_path) -> None:
    first, second = str(tmp_path / "a"), str(tmp_path / "b")
    _tiny(0).save_pretrained(first)
    _tiny(1).save_pretrained(second)
    sched = Scheduler(first)
    sched.device, sched.dtype, sched.quantization = "cpu", "bfloat16", "fp8"
    sched.load()
    assert sched.driver is None  # the HF path (a CPU with --decode-path auto)
    ok, message = sched.update_weights(second, "1", flush_cache=False, abort_all=False)
    assert ok, message
    expected = _tiny(1)
    for name, layer in fp8_linears(expected).items():
        served = torch.tensor(served_rows(sched.model, f"{name}.weight", 10**6))
        assert torch.equal(served, dequantize_fp8_blockwise(*quantize_fp8_blockwise(layer.weight)))
    norm = torch.tensor(served_rows(sched.model, "model.norm.weight", 10**6))
    assert torch.equal(norm, expected.model.norm.weight.to(torch.bfloat16).float())


def test_served_state_quantises_an_unquantised_weight_and_takes_an_fp8_one_as_it_is() -> None:
    engine = _tiny(0)
    serve_fp8(engine, torch.bfloat16)
    name = "model.layers.0.self_attn.k_proj.weight"
    w = torch.randn(64, 128)
    q, scale = quantize_fp8_blockwise(w * 2)
    unquantised = served_state(engine, {name: w})
    assert torch.equal(unquantised[name].float(), quantize_fp8_blockwise(w)[0].float())
    assert torch.equal(unquantised[scale_name(name)], quantize_fp8_blockwise(w)[1])
    given = served_state(engine, {name: q, scale_name(name): scale})
    assert given[name] is q and given[scale_name(name)] is scale


def test_fp8_launch_flags_parse_and_a_non_float_dtype_is_refused(tmp_path) -> None:
    cmd = engine_command(RolloutConfig(), "/m", "0", colocated=False, host="127.0.0.1", precision="fp8")
    args = parse_args(cmd.resolve(port=30000, python="python").argv()[3:])
    assert (args.dtype, args.quantization) == ("bfloat16", "fp8")
    _tiny(0).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=r"--quantization fp8 dequantises to the model's --dtype, a float type"):
        load_model(str(tmp_path), torch.device("cpu"), torch.int8, "fp8", lambda: 0)


def test_the_receiver_refuses_a_float_weight_for_an_fp8_one_and_the_reverse_never_casting() -> None:
    fp8_engine, plain_engine = _tiny(0), _tiny(0)
    serve_fp8(fp8_engine, torch.bfloat16)
    name = "model.layers.0.mlp.gate_proj.weight"
    float_spec = {"name": name, "dtype": "bfloat16", "shape": [320, 128]}
    fp8_spec = {"name": name, "dtype": "float8_e4m3fn", "shape": [320, 128]}
    refusal = (r"gate_proj.weight: dtype {} cannot load into {} \(a cast would drop or ignore the block scales\): "
               r"fp8 weights go to an engine started with --quantization fp8, from a trainer with "
               r"precision.rollout fp8")
    assert WeightReceiver(SimpleNamespace(model=fp8_engine)).problems([fp8_spec]) is None
    assert re.search(refusal.format("bfloat16", "float8_e4m3fn"),
                     WeightReceiver(SimpleNamespace(model=fp8_engine)).problems([float_spec]) or "")
    assert re.search(refusal.format("float8_e4m3fn", "float32"),
                     WeightReceiver(SimpleNamespace(model=plain_engine)).problems([fp8_spec]) or "")


def test_the_fast_path_serves_fp8_layers_unfused_with_the_hf_forwards_numbers() -> None:
    """static_model.py computes an fp8 layer's projections with its own modules (dequantised
    weights): prefill and decode logits are the HF forward's of the same fp8 model, and the
    greedy tokens the HF path's. CUDA graphs of the same code: tests/gpu."""
    from milepost.core.engine.continuous import ContinuousGenerator
    from milepost.core.engine.generation import Generator, SamplingParams, Sequence
    from milepost.core.engine.static_model import StaticDecoder

    model = _tiny(0)
    serve_fp8(model, torch.float32)
    dec = StaticDecoder(model, num_slots=2, max_len=32, use_graphs=False)
    dec.allocate()
    prompts, nxt = [[3, 4, 5], [7, 8, 9, 10, 11]], torch.tensor([6, 13])
    with torch.inference_mode():
        last = dec.prefill(prompts, 0, all_logits=False)
        assert dec._fused == [None, None]  # not fused: fp8 weights with their own scales
        dec.in_tokens[:2], dec.in_pos[:2] = nxt, torch.tensor([len(p) for p in prompts])
        step = dec.decode(2, max(len(p) for p in prompts))
        for i, p in enumerate(prompts):
            ref = model(torch.tensor([p + [int(nxt[i])]])).logits[0]
            assert torch.allclose(last[i], ref[-2], atol=1e-5) and torch.allclose(step[i], ref[-1], atol=1e-5)
    params = dict(max_new_tokens=8, temperature=0.0, ignore_eos=True)
    fast, queue = [], [Sequence(p, SamplingParams(**params), seed=0) for p in prompts]
    assert ContinuousGenerator(model, [1], num_slots=2, max_len=32, use_graphs=False).run(
        lambda free: [queue.pop(0) for _ in range(min(free, len(queue)))], fast.append)
    ref = [Sequence(p, SamplingParams(**params), seed=0) for p in prompts]
    Generator(model, [1]).run_batch(ref)
    assert sorted(s.output_ids for s in fast) == sorted(r.output_ids for r in ref)


def test_a_staging_backend_stages_the_weights_the_sent_scales_come_from() -> None:
    from milepost.core.train.weight_sender import source_names
    sent = ["m.layers.0.q.weight_scale_inv", "m.layers.0.q.weight", "m.norm.weight", "m.layers.1.q.weight_scale_inv"]
    assert source_names(sent, "fp8") == ["m.layers.0.q.weight", "m.norm.weight", "m.layers.1.q.weight"]
    assert source_names(sent, None) == sent
