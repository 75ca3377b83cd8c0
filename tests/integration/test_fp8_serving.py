"""FP8 rollout end to end (issue 21): weights quantised on sync, served block-wise fp8.

A trainer (TorchBackend, fp32, one rank in a real Ray actor) whose weight sender sends
precision.rollout fp8's format, and a real built-in engine process launched with that mode's
flags (`--dtype bfloat16 --quantization fp8`). Each round the engine samples responses with its
logprobs, the trainer takes an optimizer step on them, and the new weights go through one
transport (disk: the trainer's unquantised export, quantised by the engine; tensor and
distributed: fp8 values and 128 x 128 scales quantised by the trainer). After every push each
fp8 Linear the engine serves (/get_weights_by_name: the weight its matmuls use) is bit for bit
the block-wise dequantisation of the trainer's fp32 master weight, and every other tensor the
master weight in bf16. The trainer/engine logprob gap of fp32 training against fp8 rollout is
printed (it is what TIS corrects); it must be larger than fp32 against fp32 (~1e-6 here,
test_int4_serving.py) and small enough that the samples are the policy's.
"""

from __future__ import annotations

import pytest
import ray
import torch
from tinymodels import engine_samples, served_weight, start_engines, stop_engines
from transformers import Qwen2Config, Qwen2ForCausalLM

from milepost.core.config import AlgoConfig, RolloutConfig, TrainConfig
from milepost.core.fleet.client import EngineClient
from milepost.core.fleet.fleet import Fleet
from milepost.core.fleet.launcher import LaunchError, engine_command
from milepost.core.quant.fp8 import dequantize_fp8_blockwise, quantize_fp8_blockwise, served_in_fp8
from milepost.core.quant.modes import sent_weight_format
from milepost.core.train.torch_backend import TorchBackend
from milepost.core.weight_sync import WeightSyncError, build_transport

PROMPTS = [[3, 4, 5], [7, 8, 9, 10], [11, 12], [13, 14, 15, 16, 17]]


def _model(path: str, seed: int = 0) -> None:
    """A 2-layer Qwen2, hidden 128, intermediate 320 (ragged 128 x 128 blocks), tied head."""
    torch.manual_seed(seed)
    Qwen2ForCausalLM(Qwen2Config(vocab_size=48, hidden_size=128, intermediate_size=320, num_hidden_layers=2,
                                 num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True,
                                 max_position_embeddings=128, eos_token_id=1, pad_token_id=0)).save_pretrained(path)


def _push(transport_name: str, client, backend, export: str, version: str) -> None:
    transport = build_transport(transport_name, timeout_s=60, num_attempts=1)
    try:
        transport.push([client], export, version, backend=backend)
    finally:
        transport.close()


def test_fp8_engine_serves_the_trainers_block_quantised_weights_bit_for_bit_after_every_transport(tmp_path) -> None:
    path = str(tmp_path / "model")
    _model(path)
    argv = engine_command(RolloutConfig(), path, "0", colocated=False, host="127.0.0.1", precision="fp8").argv()
    flags = argv[argv.index("--dtype"):argv.index("--weight-version")]
    assert flags == ["--dtype", "bfloat16", "--quantization", "fp8"]  # what precision.rollout fp8 launches
    ray.init(num_cpus=2, include_dashboard=False)
    engines = start_engines(path, tmp_path, 1, *flags, "--weight-update-timeout-s", "30")
    cfg = TrainConfig(num_ranks=1, micro_batch_size=8, lr=1e-2)
    backend = TorchBackend.create(path, cfg, AlgoConfig(), 1.0, seed=0, weight_format=sent_weight_format("fp8"))
    try:
        client, url = engines[0][1], engines[0][1].base_url
        assert client.server_info()["quantization"] == "fp8"
        master = backend.state_dict()
        layers = sorted(n for n, t in master.items() if served_in_fp8(n, t.shape))
        assert len(layers) == 14
        gaps, before = [], served_weight(url, layers[0])
        for step, name in enumerate(("disk", "tensor", "distributed"), start=1):
            # the trainer's forward vs the engine's logprobs
            metrics = backend.train_step(engine_samples(client, PROMPTS, step), step)
            gaps.append(metrics["train/engine_logprob_diff_max"])
            export = str(tmp_path / f"export{step}")
            if name == "disk":
                backend.export_hf(export)  # unquantised: the engine quantises it as at load
            _push(name, client, backend, export, str(step))
            master = backend.state_dict()
            for layer in layers:
                expected = dequantize_fp8_blockwise(*quantize_fp8_blockwise(master[layer]))
                assert torch.equal(served_weight(url, layer), expected), f"{name}: {layer}"
            for other in ("model.norm.weight", "model.layers.1.self_attn.q_proj.bias"):
                expected = master[other].to(torch.bfloat16).float()
                assert torch.equal(served_weight(url, other), expected), f"{name}: {other}"
            now = served_weight(url, layers[0])
            assert not torch.equal(now, before)  # the step changed the served fp8 weights
            before = now
        print(f"max |trainer fp32 - engine fp8| logprob per round: {[f'{g:.2e}' for g in gaps]}")
        assert 1e-4 < max(gaps) < 0.5, gaps
    finally:
        backend.shutdown()
        stop_engines(engines)
        ray.shutdown()


def test_a_trainer_sending_unquantised_weights_to_an_fp8_engine_is_refused_by_name(tmp_path) -> None:
    path = str(tmp_path / "model")
    _model(path)
    ray.init(num_cpus=2, include_dashboard=False)
    engines = start_engines(path, tmp_path, 1, "--dtype", "bfloat16", "--quantization", "fp8",
                            "--weight-update-timeout-s", "30")
    backend = TorchBackend.create(path, TrainConfig(num_ranks=1, micro_batch_size=8), AlgoConfig(), 1.0, seed=0)
    try:
        client = engines[0][1]
        with pytest.raises(WeightSyncError, match=r"q_proj.weight: dtype float32 cannot load into float8_e4m3fn .*"
                                                  r"from a trainer with precision.rollout fp8"):
            _push("tensor", client, backend, "", "1")
        assert client.model_info()["weight_version"] != "1"  # nothing half-loaded: the push was refused whole
        reply = client.generate([PROMPTS[0]], [{"max_new_tokens": 2, "ignore_eos": True}])
        assert len(reply[0]["output_ids"]) == 2  # still serving
    finally:
        backend.shutdown()
        stop_engines(engines)
        ray.shutdown()


def test_sglang_fp8_fleets_hand_engines_the_fp8_copy_of_every_folder_and_it_serves_the_same_bits(tmp_path) -> None:
    """A fleet of SGLang engines serving fp8 gives every disk load the block-wise fp8 copy of
    the folder (Fleet.disk_form through its engine clients: disk pushes, restarts, wakes,
    restores) and launches from the base model's copy. SGLang cannot run here, so the copy is
    loaded by a real built-in fp8 engine over HTTP, which takes fp8 tensors as they are: it
    then serves exactly what a second engine serves after quantising the unquantised folder
    itself, tensor by tensor."""
    base, trained = str(tmp_path / "model"), str(tmp_path / "trained")
    _model(base)
    _model(trained, seed=1)  # the next policy: same shapes, other weights
    fleet = Fleet(base, "0", RolloutConfig(engine="sglang"), "127.0.0.1", str(tmp_path / "logs"))
    fleet.precision = "fp8"
    argv = fleet.engine_command().argv()
    launch = argv[argv.index("--model-path") + 1]
    assert launch.startswith(f"{tmp_path}/logs/served/base/model-fp8-") and launch == fleet.disk_form(base)
    flags = argv[argv.index("--dtype"):argv.index("--weight-version")]
    assert flags == ["--dtype", "bfloat16", "--quantization", "fp8"]
    with pytest.raises(LaunchError, match=r"k/v projection \(num_key_value_heads x head_dim\) is 64"):
        fleet.check_disk_form()  # hidden 128 / 4 heads: SGLang could not block it (builtin serves it)
    engines = start_engines(base, tmp_path, 2, "--dtype", "bfloat16", "--quantization", "fp8")
    try:
        url, own_url = engines[0][1].base_url, engines[1][1].base_url
        mapped = EngineClient(url, timeout_s=60, disk_form=fleet.disk_form)  # what Fleet.engine_client builds
        assert mapped.update_weights_from_disk(trained, weight_version="1")["success"]
        assert engines[1][1].update_weights_from_disk(trained, weight_version="1")["success"]
        copy = mapped.model_info()["model_path"]
        assert copy == fleet.disk_form(trained) and copy.startswith(f"{tmp_path}/logs/served/policies/trained-fp8-")
        names = [n for n, _ in Qwen2ForCausalLM.from_pretrained(trained).named_parameters()]
        for name in names:
            assert torch.equal(served_weight(url, name), served_weight(own_url, name)), name
        q = "model.layers.0.self_attn.q_proj.weight"
        assert not torch.equal(served_weight(url, q), dequantize_fp8_blockwise(*quantize_fp8_blockwise(
            Qwen2ForCausalLM.from_pretrained(base).state_dict()[q])))  # the new policy, not the base
        for client in (mapped, engines[1][1]):  # both still serve
            reply = client.generate([PROMPTS[0]], [{"max_new_tokens": 2, "ignore_eos": True}])
            assert len(reply[0]["output_ids"]) == 2
    finally:
        stop_engines(engines)
