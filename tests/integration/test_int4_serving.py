"""INT4 QAT end to end (issue 21, must-show 3): the policy trained is the policy served.

A trainer with precision.train int4_qat (the torch backend, and the megatron backend, whose fused
qkv and gate/up rows quantise as their HF rows: one rank in a real Ray actor) and a real
built-in engine process launched with precision.rollout int4's flags (`--dtype float32
--quantization int4`), on the HF path and on the fast path. Each round the engine samples
responses (with its logprobs), the trainer takes an optimizer step on them, and the new
weights are pushed through one transport (disk, tensor, distributed). After every push, every
quantised Linear the engine serves (SGLang's /get_weights_by_name: the weight its matmuls use)
is bit for bit `fake_quantize_int4` of the trainer's fp32 master weight — what the trainer's
forward computes with — and the trainer's forward gives the engine's logprobs of the engine's
samples.
"""

from __future__ import annotations

import pytest
import ray
import torch
from tinymodels import engine_samples, served_weight, start_engines, stop_engines
from transformers import Qwen2Config, Qwen2ForCausalLM

from milepost.core.config import AlgoConfig, RolloutConfig, TrainConfig
from milepost.core.fleet.launcher import engine_command
from milepost.core.quant.int4 import fake_quantize_int4, quantized_linears
from milepost.core.train.factory import create_backend
from milepost.core.weight_sync import build_transport

PROMPTS = [[3, 4, 5], [7, 8, 9, 10], [11, 12], [13, 14, 15, 16, 17]]


def _model(path: str) -> list[str]:
    """A 2-layer Qwen2, hidden 128 (one group of 128 per row), intermediate 320 (down_proj:
    groups 128 + 128 + a ragged 64); returns its quantised Linears' names."""
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(vocab_size=48, hidden_size=128, intermediate_size=320, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True,
                                         max_position_embeddings=128, eos_token_id=1, pad_token_id=0))
    model.save_pretrained(path)
    return sorted(quantized_linears(model))


@pytest.mark.parametrize("backend_name,decode_path", [("torch", "auto"), ("megatron", "auto"), ("torch", "static")])
def test_int4_engine_serves_the_trainers_fake_quantised_weights_bit_for_bit_after_every_transport(
        tmp_path, backend_name: str, decode_path: str) -> None:
    """decode_path `auto` is the HF path on CPU; `static` is the fast path a GPU engine takes
    (CUDA graphs aside), re-quantising before the forward that follows each push."""
    path = str(tmp_path / "model")
    layers = _model(path)
    argv = engine_command(RolloutConfig(), path, "0", colocated=False, host="127.0.0.1", precision="int4").argv()
    flags = argv[argv.index("--dtype"):argv.index("--weight-version")]
    assert flags == ["--dtype", "float32", "--quantization", "int4"]  # what precision.rollout int4 launches
    ray.init(num_cpus=2, include_dashboard=False)
    engines = start_engines(path, tmp_path, 1, *flags, "--weight-update-timeout-s", "30", "--decode-path", decode_path)
    backend = create_backend(path, TrainConfig(backend=backend_name, num_ranks=1, micro_batch_size=8, lr=1e-2),
                             AlgoConfig(), 1.0, seed=0, precision="int4_qat", rollout_precision="int4")
    try:
        client, url = engines[0][1], engines[0][1].base_url
        info = client.server_info()
        assert info["quantization"] == "int4" and info["decode_path"] == ("fast" if decode_path == "static" else "hf")
        gaps, before = [], served_weight(url, f"{layers[0]}.weight")
        for step, name in enumerate(("disk", "tensor", "distributed"), start=1):
            # the trainer's forward vs the engine's logprobs
            metrics = backend.train_step(engine_samples(client, PROMPTS, step), step)
            gaps.append(metrics["train/engine_logprob_diff_max"])
            export = str(tmp_path / f"export{step}")
            if name == "disk":
                backend.export_hf(export)
            transport = build_transport(name, timeout_s=60)
            try:
                transport.push([client], export, str(step), backend=backend)
            finally:
                transport.close()
            master = backend.state_dict()
            for layer in layers:
                served, weight = served_weight(url, f"{layer}.weight"), master[f"{layer}.weight"]
                assert torch.equal(served, fake_quantize_int4(weight)), f"{name}: {layer}"
                assert not torch.equal(served, weight)  # int4, not the pushed fp32 weight
            assert torch.equal(served_weight(url, "model.norm.weight"), master["model.norm.weight"])
            now = served_weight(url, f"{layers[0]}.weight")
            assert not torch.equal(now, before)  # the step changed the int4 weights: re-quantised, not stale
            before = now
        assert max(gaps) < 1e-4, gaps  # the policy trained is the policy served
        print(f"max |trainer - engine| logprob per round: {[f'{g:.2e}' for g in gaps]}")
    finally:
        backend.shutdown()
        stop_engines(engines)
        ray.shutdown()
