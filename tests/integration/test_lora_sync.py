"""LoRA on real parts: the torch backend (2 gloo ranks, Ray actors) trains an adapter on
samples two built-in engine processes generated, LoraTransport pushes only the adapter over
real HTTP, and the engines' logprobs then equal the trainer's; a backend restored from a
checkpoint takes the next step bitwise as the uninterrupted one does.

(The campaign-level numbers — learning, bytes per push, a SIGKILLed campaign resumed — are
measured by bench/lora_campaign.py, recorded in bench/results/lora_tiny_arith.txt.)
"""

from __future__ import annotations

from pathlib import Path

import pytest
import ray
import torch
from tinymodels import save_tiny_qwen2, start_engines, stop_engines

from milepost.core.config import AlgoConfig, LoraConfig, TrainConfig
from milepost.core.fleet.client import EngineClient, EngineError
from milepost.core.train import lora
from milepost.core.train.torch_backend import TorchBackend
from milepost.core.types import Sample
from milepost.core.weight_sync.lora_push import ADAPTER_NAME, AdapterRequests, LoraTransport, load_body, unload_body

LORA = LoraConfig(rank=4, alpha=8.0, target_modules=["q_proj", "v_proj", "gate_proj", "down_proj"])
TRAIN = TrainConfig(num_ranks=2, micro_batch_size=4, lr=5e-2, lora=LORA)
PROMPTS = [[3, 4, 5], [7, 8, 9, 10], [11, 12], [13, 14, 15]]
SAMPLING = {"max_new_tokens": 6, "temperature": 1.0, "ignore_eos": True}
# fp32 on CPU: batched engine forwards differ from the trainer's in the low bits (measured up to
# 1.3e-5 with an adapter in tiny-arith-lora); a missing or stale adapter is off by > 1e-3
GAP = 5e-5


def rollout(clients: list[AdapterRequests], seed: int) -> list[Sample]:
    """Two samples per prompt from the engines (round robin), with made-up rewards."""
    samples = []
    for i, prompt in enumerate(PROMPTS * 2):
        out = clients[i % len(clients)].generate(prompt, {**SAMPLING, "sampling_seed": seed + i}, return_logprob=True)
        ids = out["output_ids"]
        samples.append(Sample(prompt_index=i % 4, group_index=i % 4, prompt_ids=prompt, response_ids=ids,
                              engine_logprobs=[e[0] for e in out["meta_info"]["output_token_logprobs"]],
                              loss_mask=[1] * len(ids), finish_reason="length", weight_version="",
                              label="", advantage=1.0 if i < 4 else -1.0))
    return samples


def trainer_gap(backend: TorchBackend, samples: list[Sample]) -> float:
    """max |engine - trainer| logprob over the samples' tokens, under the trainer's current weights."""
    from milepost.core.train.batch import collate
    from milepost.core.train.logprobs import response_logprobs
    module = ray.get(backend.actors[0].__ray_call__.remote(lambda w: w.module))
    batch = collate(samples, 0)
    with torch.no_grad():
        lp = response_logprobs(module, batch, 1.0)
    mask = batch["loss_mask"].bool()
    return float((lp - batch["engine_logprobs"]).abs()[mask].max())


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora")
    base = save_tiny_qwen2(root / "base", 0, vocab=48, tie_embeddings=True, max_positions=256)
    started = start_engines(base, root, 2, "--enable-lora", "--max-lora-rank", "8", "--lora-target-modules",
                            *LORA.target_modules)
    ray.init(num_cpus=4, include_dashboard=False)
    try:
        yield root, base, [c for _, c in started]
    finally:
        ray.shutdown()
        stop_engines(started)


def test_only_the_adapter_moves_and_resume_is_bitwise(setup) -> None:
    root, base, engines = setup
    served: list[str | None] = [None]
    clients = [AdapterRequests(c, lambda: served[0]) for c in engines]
    transport = LoraTransport(timeout_s=60.0)
    backend = TorchBackend.create(base, TRAIN, AlgoConfig(), 1.0, seed=3)
    try:
        for step in (1, 2):
            samples = rollout(clients, seed=100 * step)
            metrics = backend.train_step(samples, step)
            assert metrics["train/engine_logprob_diff_max"] < GAP  # the engines served the trainer's policy
            export = root / f"export{step}"
            backend.export_hf(str(export))
            sync = transport.push(engines, str(export), str(step))
            served[0] = ADAPTER_NAME
            adapter_bytes = (export / lora.ADAPTER_WEIGHTS).stat().st_size
            assert sync["sync/bytes"] == adapter_bytes
            assert sync["sync/full_weight_bytes"] == sum(f.stat().st_size for f in Path(base).glob("*.safetensors"))
            assert adapter_bytes < sync["sync/full_weight_bytes"] / 4
            assert all(e.model_info()["weight_version"] == str(step) for e in engines)
        after = rollout(clients, seed=300)
        assert trainer_gap(backend, after) < GAP  # the pushed adapter is applied in the engines' forward
        served[0] = None
        assert trainer_gap(backend, rollout(clients, seed=300)) > 1e-3  # without lora_path: the base model
        served[0] = ADAPTER_NAME
        backend.save_state(str(root / "ckpt"))
        assert sorted(p.name for p in (root / "ckpt").iterdir()) == [
            "meta.json", "model.pt", "optim_rank0.pt", "optim_rank1.pt", "rng_rank0.pt", "rng_rank1.pt", "scheduler.pt"]
        uninterrupted = backend.train_step(after, 3)
        sha = backend.weights_sha256()
    finally:
        backend.shutdown()
    resumed = TorchBackend.create(base, TRAIN, AlgoConfig(), 1.0, seed=3)
    try:
        resumed.load_state(str(root / "ckpt"))
        again = resumed.train_step(after, 3)
        assert resumed.weights_sha256() == sha
        assert again["train/loss"] == uninterrupted["train/loss"]
        assert again["train/grad_norm"] == uninterrupted["train/grad_norm"]
    finally:
        resumed.shutdown()


def test_a_failed_load_leaves_the_last_good_adapter_served(setup) -> None:
    root, base, engines = setup
    transport = LoraTransport(timeout_s=30.0, num_attempts=1)
    good = root / "export2"  # pushed whole by the test above, or made here when it ran alone
    if not good.exists():
        backend = TorchBackend.create(base, TRAIN, AlgoConfig(), 1.0, seed=3)
        try:
            backend.export_hf(str(good))
        finally:
            backend.shutdown()
    transport.push(engines, str(good), "7")
    broken = root / "broken"
    broken.mkdir()
    (broken / lora.ADAPTER_CONFIG).write_text((good / lora.ADAPTER_CONFIG).read_text())
    (broken / lora.ADAPTER_WEIGHTS).write_bytes(b"not safetensors")
    with pytest.raises(Exception, match="did not take adapter version 8"):
        transport.push(engines, str(broken), "8")
    for e in engines:
        assert e.model_info()["weight_version"] == "7"
        e.generate([3, 4], {"max_new_tokens": 2}, lora_path=ADAPTER_NAME)  # still loaded
    with pytest.raises(EngineError, match="not loaded: other"):
        engines[0].generate([3, 4], {"max_new_tokens": 2}, lora_path="other")
    assert isinstance(engines[0], EngineClient)


def test_the_adapter_requests_are_sglangs(tmp_path) -> None:
    """What LoraTransport and the rollout send, parsed by SGLang 0.5.23's own request classes."""
    import sglang_oracle
    try:
        sgl = sglang_oracle.load()
    except sglang_oracle.SGLangMissing as exc:
        pytest.fail(str(exc), pytrace=False)
    load = sglang_oracle.request(sgl, "LoadLoRAAdapterReqInput", load_body(str(tmp_path)))
    assert (load.lora_name, load.lora_path, load.pinned) == (ADAPTER_NAME, str(tmp_path), False)
    assert sglang_oracle.request(sgl, "UnloadLoRAAdapterReqInput", unload_body()).lora_name == ADAPTER_NAME
    generate = sglang_oracle.request(sgl, "GenerateReqInput", {"input_ids": [[3, 4], [5]], "sampling_params": SAMPLING,
                                                              "return_logprob": True, "lora_path": ADAPTER_NAME})
    assert generate.lora_path == ADAPTER_NAME
