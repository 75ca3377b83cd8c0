"""MoE routing replay on real parts: two built-in engine processes serving a tiny random
Qwen3-MoE (the launcher adds --enable-return-routed-experts), the real sglang-router, the
direct-to-engines client, an engine SIGKILLed mid-rollout, and the trainer's forward
replaying the routes the engines returned."""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import httpx
import pytest
import ray
import torch
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

from milepost.core.algo.routing_replay import RankReplay, decode_routes
from milepost.core.config import RolloutConfig
from milepost.core.fleet.direct import direct_client
from milepost.core.fleet.fleet import Fleet
from milepost.core.model.loading import load_causal_lm
from milepost.core.rollout import RolloutRequest, default_rollout
from milepost.core.train.batch import collate
from milepost.core.train.logprobs import response_logprobs
from milepost.core.types import Prompt

LAYERS, TOP_K, N = 2, 2, 4
PROMPTS = [Prompt(index=i, text="", label="", prompt_ids=[2 + i % 20, 3, 4 + i % 7]) for i in range(16)]
REQUEST = RolloutRequest(PROMPTS, N, {"max_new_tokens": 48, "temperature": 1.0, "ignore_eos": True},
                         sampling_seed=7, num_engines=2, decode=lambda ids: "", return_routed_experts=True)


def save_tiny_moe(path: Path, seed: int) -> str:
    torch.manual_seed(seed)
    cfg = Qwen3MoeConfig(vocab_size=32, hidden_size=32, intermediate_size=64, num_hidden_layers=LAYERS,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_experts=4,
                         num_experts_per_tok=TOP_K, moe_intermediate_size=16, max_position_embeddings=256,
                         eos_token_id=1, pad_token_id=0)
    model = Qwen3MoeForCausalLM(cfg)
    with torch.no_grad():
        for layer in model.model.layers:  # a real routing choice, not the near-uniform init
            layer.mlp.gate.weight.normal_(0.0, 1.0)
    model.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    cfg = RolloutConfig(num_engines=2, health_check_interval_s=0.5, health_failure_threshold=2,
                        engine_startup_timeout_s=90.0, request_timeout_s=60.0, max_engine_restarts=2)
    f = Fleet.start(save_tiny_moe(tmp_path_factory.mktemp("moe"), 0), 2, cfg)
    yield f
    f.stop()
    ray.shutdown()


def _by_prompt(samples) -> dict[int, list[tuple[list[int], tuple[int, ...]]]]:
    """Tokens and the shape of the routes per prompt (routes of a retried request come from
    another engine's batch: the same experts but for near-ties, so they are checked by replay)."""
    grouped: dict[int, list] = {}
    for s in samples:
        grouped.setdefault(s.prompt_index, []).append(
            (s.response_ids, decode_routes(s.routed_experts, LAYERS, TOP_K).shape))
    return grouped


def test_moe_rollout_goes_to_the_engines_survives_a_death_and_replays_exactly(fleet) -> None:
    assert "--enable-return-routed-experts" in fleet.engine_command().argv()
    # The router drops return_routed_experts (FACTS.md): through it no routes come back.
    via_router = fleet.router_client.generate([3, 4, 5], {"max_new_tokens": 2}, return_routed_experts=True)
    assert "routed_experts" not in via_router["meta_info"]
    client = direct_client(fleet)
    reference = default_rollout(REQUEST, client)
    served = client.inner.num_requests  # 2 chunks x N concurrent requests: least in flight spreads them
    assert len(served) == 2 and sum(served.values()) == 2 * N and min(served.values()) >= N // 2, served
    for s in reference:
        routes = decode_routes(s.routed_experts, LAYERS, TOP_K)
        assert routes.shape == (len(s.prompt_ids) + len(s.response_ids) - 1, LAYERS, TOP_K)

    box: dict = {}
    rollout = threading.Thread(target=lambda: box.update(samples=default_rollout(REQUEST, client)))
    rollout.start()
    while rollout.is_alive() and httpx.get(f"{fleet.engine_urls[0]}/get_load", timeout=5).json()[0]["num_tokens"] == 0:
        time.sleep(0.02)
    assert rollout.is_alive(), "the kill must land while the rollout runs"
    os.kill(ray.get(fleet.actors[0].pid.remote()), signal.SIGKILL)
    rollout.join(180)
    # Nothing lost or duplicated; the retried requests gave the same tokens, with their routes.
    samples = box["samples"]
    assert _by_prompt(samples) == _by_prompt(reference)
    assert client.num_retries > 0

    trainer = load_causal_lm(fleet.base_model_path)
    replay = RankReplay.attach(trainer, force=True)
    batch = collate(samples, pad_id=0)
    routes = replay.routes(samples, batch)
    with torch.no_grad(), replay.applied(routes):
        lp = response_logprobs(trainer, batch, 1.0)
    gap = (lp - batch["engine_logprobs"]).abs()[batch["loss_mask"].bool()]
    agree, compared = replay.tap.agreement()
    assert gap.mean() <= 1e-5 and agree == compared > 0
