"""The built-in engine serving int4 (core/engine/quantized.py): it stores packed int4 values and
float32 scales, computes exactly what the int4_qat trainer computes, re-quantises when the
weight receiver counts a change of the live weights (a disk update here; the pushed
transports through a real engine process: tests/integration/test_int4_serving.py), needs
--dtype float32 or bfloat16, serves on either path (the fast path re-quantises in place before
a forward, and frees the int4 values with the weights), and gets its flags from precision.rollout."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from milepost.core.config import RolloutConfig
from milepost.core.engine.fast_path import fast_path_problem
from milepost.core.engine.quantized import Int4Linear, forget_int4, load_model, serve_int4, served_rows
from milepost.core.engine.scheduler import Scheduler
from milepost.core.engine.server import parse_args
from milepost.core.fleet.launcher import engine_command
from milepost.core.quant.int4 import fake_quantize_int4, num_groups, quantized_linears, unpack_int4
from milepost.core.train.precision import attach_int4_qat

IDS = torch.randint(2, 40, (2, 9), generator=torch.Generator().manual_seed(0))


def _tiny(seed: int) -> Qwen2ForCausalLM:
    """hidden 128 (one group of 128), intermediate 320 (down_proj: 128 + 128 + a ragged 64)."""
    torch.manual_seed(seed)
    cfg = Qwen2Config(vocab_size=40, hidden_size=128, intermediate_size=320, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, tie_word_embeddings=True, eos_token_id=1, pad_token_id=0)
    return Qwen2ForCausalLM(cfg).float().eval()


def test_int4_serving_stores_packed_values_and_scales_and_computes_what_the_qat_trainer_computes() -> None:
    engine, trainer = _tiny(0), _tiny(0)
    names = serve_int4(engine, lambda: 0)
    attach_int4_qat(trainer)
    assert names == sorted(quantized_linears(trainer)) and len(names) == 14
    for layer in quantized_linears(engine).values():
        assert isinstance(layer, Int4Linear)
        out, cols = layer.weight.shape
        assert layer.weight_packed.dtype == torch.int32 and layer.weight_packed.shape == (out, -(-cols // 8))
        assert layer.weight_scale.dtype == torch.float32 and layer.weight_scale.shape == (out, num_groups(cols))
        assert int(unpack_int4(layer.weight_packed, cols).abs().max()) == 7
    assert engine.model.layers[0].mlp.down_proj.weight_scale.shape == (128, 3)
    with torch.no_grad():
        assert torch.equal(engine(input_ids=IDS).logits, trainer(input_ids=IDS).logits)
    assert set(engine.state_dict()) == set(_tiny(0).state_dict())  # what weight updates fill is unchanged


def test_a_layer_requantises_when_the_receiver_counts_a_change_and_only_then() -> None:
    model, generation = _tiny(0), [0]
    serve_int4(model, lambda: generation[0])
    layer = model.model.layers[1].self_attn.o_proj
    old = layer.served_weight()
    new = torch.randn_like(layer.weight) * 0.05
    layer.weight.data = new
    assert torch.equal(layer.served_weight(), old)  # uncounted: nothing tells it (the receiver always counts)
    generation[0] += 1
    assert torch.equal(layer.served_weight(), fake_quantize_int4(new))


def test_int4_values_made_again_in_inference_mode_can_be_refreshed_outside_it() -> None:
    """After a release (forget_int4) the fast path's first forward, in inference mode, makes
    the int4 values again; the next change may be read first by /get_weights_by_name, in
    normal mode: the refresh writes them in place all the same."""
    model, generation = _tiny(0), [0]
    serve_int4(model, lambda: generation[0])
    assert forget_int4(model) == 14 and forget_int4(model) == 0
    with torch.inference_mode():
        model(input_ids=IDS)
    layer = model.model.layers[0].self_attn.o_proj
    new = torch.randn_like(layer.weight) * 0.05
    with torch.no_grad():
        layer.weight.copy_(new)
    generation[0] += 1
    assert torch.equal(layer.served_weight(), fake_quantize_int4(new))


def _int4_scheduler(tmp_path, decode_path: str) -> tuple[Scheduler, str]:
    """A loaded float32 int4 engine of _tiny(0) on CPU, and the folder of _tiny(1) to update to."""
    first, second = str(tmp_path / "a"), str(tmp_path / "b")
    _tiny(0).save_pretrained(first)
    _tiny(1).save_pretrained(second)
    sched = Scheduler(first)
    sched.device, sched.dtype, sched.quantization, sched.decode_path = "cpu", "float32", "int4", decode_path
    sched.mem_fraction_static = 0.01 if decode_path == "static" else None  # the fast path's cache: 1 % of the RAM
    sched.load()
    return sched, second


def _update_serves_the_fake_quantised_new_weights(sched: Scheduler, folder: str) -> Qwen2ForCausalLM:
    ok, message = sched.update_weights(folder, "1", flush_cache=False, abort_all=False)
    assert ok, message
    expected = _tiny(1)
    for name, layer in quantized_linears(expected).items():
        served = torch.tensor(served_rows(sched.model, f"{name}.weight", 10**6))
        assert torch.equal(served, fake_quantize_int4(layer.weight))
    return expected


def test_a_disk_update_is_served_as_the_fake_quantised_new_weights(tmp_path) -> None:
    sched, second = _int4_scheduler(tmp_path, "auto")
    assert sched.driver is None  # the HF path
    expected = _update_serves_the_fake_quantised_new_weights(sched, second)
    assert torch.equal(torch.tensor(served_rows(sched.model, "model.norm.weight", 10**6)), expected.model.norm.weight)
    assert len(served_rows(sched.model, "model.embed_tokens.weight", 5)) == 5  # SGLang's truncate_size: rows


def test_a_bf16_int4_engine_serves_what_a_bf16_int4_qat_trainer_computes_bit_for_bit(tmp_path) -> None:
    """The megatron backend trains int4_qat in bf16 on GPUs (modes.int4_dtype), and pushes its bf16
    weights: an engine at --dtype bfloat16 holds them as they are and dequantises the same q and
    scales to bf16, which is the trainer's fake-quantised weight (a bf16 weight's, computed in fp32)."""
    _tiny(0).save_pretrained(tmp_path)
    model = load_model(str(tmp_path), torch.device("cpu"), torch.bfloat16, "int4", lambda: 0)
    trainer = _tiny(0).to(torch.bfloat16)  # the trainer's bf16 parameters, cast from the same checkpoint
    for name, layer in quantized_linears(trainer).items():
        served = model.get_submodule(name)
        assert isinstance(served, Int4Linear) and served.weight.dtype == torch.bfloat16
        trained = fake_quantize_int4(layer.weight)
        assert trained.dtype == torch.bfloat16 and torch.equal(served.served_weight(), trained)
        # not the fp32 engine's: the product rounded to bf16 differs from it in most elements
        assert not torch.equal(trained.float(), fake_quantize_int4(layer.weight.float()))


def test_int4_needs_float32_or_bfloat16(tmp_path) -> None:
    _tiny(0).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=r"--quantization int4 dequantises to .* float32 or bfloat16, not "
                                         r"torch.float16: pass --dtype float32 or --dtype bfloat16"):
        load_model(str(tmp_path), torch.device("cpu"), torch.float16, "int4", lambda: 0)
    sched = SimpleNamespace(decode_path="static", lora=SimpleNamespace(enabled=False), routed_experts=False,
                            quantization="int4")
    assert fast_path_problem(sched, _tiny(0)) is None  # int4 engines serve on the fast path


def test_the_fast_path_serves_int4_layers_unfused_and_requantises_in_place_before_a_forward() -> None:
    """static_model.py computes int4 projections with their own modules (not fused: a fused
    buffer would hold the unquantised weights), and asks each to `prepare` before a forward:
    after the receiver counts a change, the layer re-quantises into the tensors it held
    (captured CUDA graphs read them by address) and the logits are the trainer's fake-quantised
    forward of the new weights. CUDA graphs of the same code: tests/gpu/test_engine_gpu.py."""
    from milepost.core.engine.static_model import StaticDecoder

    model, generation = _tiny(0), [0]
    serve_int4(model, lambda: generation[0])
    dec = StaticDecoder(model, num_slots=2, max_len=32, use_graphs=False)
    dec.allocate()
    layers = [m for m in model.modules() if isinstance(m, Int4Linear)]
    addresses = [(m.weight_packed.data_ptr(), m.weight_scale.data_ptr()) for m in layers]
    prompts = [[3, 4, 5], [7, 8, 9, 10, 11]]

    def check(trainer: Qwen2ForCausalLM) -> None:
        nxt = torch.tensor([6, 13])
        with torch.inference_mode():
            last = dec.prefill(prompts, 0, all_logits=False)
            dec.in_tokens[:2], dec.in_pos[:2] = nxt, torch.tensor([len(p) for p in prompts])
            step = dec.decode(2, max(len(p) for p in prompts))
            for i, p in enumerate(prompts):
                ref = trainer(torch.tensor([p + [int(nxt[i])]])).logits[0]
                assert torch.allclose(last[i], ref[-2], atol=1e-5) and torch.allclose(step[i], ref[-1], atol=1e-5)

    trainer = _tiny(0)
    attach_int4_qat(trainer)
    check(trainer)
    assert dec._fused == [None, None]  # not fused: int4 values with their own scales
    new = _tiny(1)
    with torch.no_grad():  # an update copied into the live weights, as a push lands it
        for target, source in zip(model.parameters(), new.parameters()):
            target.copy_(source)
    generation[0] += 1
    attach_int4_qat(new)
    check(new)
    assert [(m.weight_packed.data_ptr(), m.weight_scale.data_ptr()) for m in layers] == addresses


def test_an_int4_engine_on_the_fast_path_serves_a_disk_update_and_frees_its_int4_values_with_its_weights(
        tmp_path) -> None:
    """The scheduler's fast path (`--decode-path static` on CPU) serves an int4 engine; a memory
    release of the weights frees each layer's packed values and scales with them, and after the
    resume and an update the engine serves the fake-quantised new weights again."""
    sched, second = _int4_scheduler(tmp_path, "static")
    assert sched.driver is not None  # the fast path
    layers = [m for m in sched.model.modules() if isinstance(m, Int4Linear)]
    assert len(layers) == 14 and all(m.weight_packed is not None for m in layers)
    status, message = sched.memory.release(["weights"])
    assert status == 200, message
    assert all(m.weight_packed is None and m.weight_scale is None for m in layers)
    status, message = sched.memory.resume(["weights"])
    assert status == 200, message
    _update_serves_the_fake_quantised_new_weights(sched, second)


@pytest.mark.parametrize("precision,int4,dtype,quantization", [
    ("fp32", "float32", "float32", None), ("bf16", "float32", "bfloat16", None),
    ("int4", "float32", "float32", "int4"), ("int4", "bfloat16", "bfloat16", "int4"),
    ("bf16", "bfloat16", "bfloat16", None)])
def test_each_rollout_precision_launches_the_builtin_engine_with_flags_it_parses(precision, int4, dtype,
                                                                                  quantization) -> None:
    cmd = engine_command(RolloutConfig(), "/m", "0", colocated=False, host="127.0.0.1", precision=precision,
                         int4_dtype=int4)
    argv = cmd.resolve(port=30000, python="python").argv()
    args = parse_args(argv[3:])
    assert (args.dtype, args.quantization) == (dtype, quantization)
