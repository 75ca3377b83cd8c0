"""The megatron backend on a Qwen3-MoE (4 experts, top-k 2) on real Ray + gloo (CPU): its
logprobs equal the HF model's at TP=1 (packed) and TP=2 (padded rows), the export round-trips
bit for bit, and routing replay forces the experts the engine recorded.

Samples come from the built-in engine's generator with its route capture on (SGLang's
`routed_experts` encoding). Sequence of backends (each ~20 s to start on 2 cores):
  megatron TP=1 (packed)   logprobs, export, step 1 (replay), step 2 on the same samples
  megatron TP=2 (padded)   the same
Step 1 replays the samples' own routes on the weights that generated them: agreement 1.0 and
the engine's logprobs within 1e-5. Step 1 moved the router (lr 2e-2), so at step 2 the
router's own top-k differs from the recorded one for some tokens: agreement < 1 and the gap
without replay differs from the gap with it.
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

from milepost.core.config import AlgoConfig, TrainConfig
from milepost.core.engine.generation import Generator, SamplingParams, make_sequences
from milepost.core.engine.routing_capture import response_routes
from milepost.core.model.loading import load_causal_lm
from milepost.core.model.moe_routing import RouterTap
from milepost.core.train.batch import collate
from milepost.core.train.factory import create_backend
from milepost.core.train.logprobs import response_logprobs
from milepost.core.types import Sample

TEMPERATURE, LR = 1.0, 2e-2
PROMPTS = [[5, 6, 7], [3, 9, 11, 12, 4, 8], [2, 3], [7, 7, 20, 4], [13, 2, 9, 30, 6]]


def save_tiny_moe(path: Path) -> str:
    torch.manual_seed(0)
    cfg = Qwen3MoeConfig(vocab_size=32, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_experts=4,
                         num_experts_per_tok=2, moe_intermediate_size=16, norm_topk_prob=True,
                         max_position_embeddings=64, eos_token_id=1, pad_token_id=0, tie_word_embeddings=True)
    model = Qwen3MoeForCausalLM(cfg)
    with torch.no_grad():
        for layer in model.model.layers:  # a real routing choice, not the near-uniform init
            layer.mlp.gate.weight.normal_(0.0, 1.0)
    model.save_pretrained(path)
    return str(path)


def engine_samples(path: str) -> list[Sample]:
    """Generated with the engine's capture on, as the server does; advantages of both signs."""
    model = load_causal_lm(path).eval()
    gen = Generator(model, eos_token_ids=[1])
    gen.route_tap = RouterTap.install(model)
    params = SamplingParams(max_new_tokens=8, temperature=TEMPERATURE, sampling_seed=4)
    seqs = [s for p in PROMPTS for s in make_sequences(p, params, 2)]
    assert gen.run_batch(seqs)
    return [Sample(prompt_index=i // 2, group_index=i // 2, prompt_ids=s.prompt_ids, response_ids=s.output_ids,
                   engine_logprobs=s.output_logprobs, loss_mask=[1] * len(s.output_ids), finish_reason="stop",
                   weight_version="0", label="", advantage=1.0 if (i // 2) % 2 else -1.0,
                   routed_experts=response_routes(s, 0))
            for i, s in enumerate(seqs)]


def megatron_cfg(tp: int, pack: bool) -> TrainConfig:
    return TrainConfig(backend="megatron", num_ranks=tp, micro_batch_size=4, lr=LR,
                       megatron={"tensor_parallel": tp, "pack_sequences": pack, "micro_batch_tokens": 48})


@pytest.fixture(scope="module")
def runs(ray_cluster, tmp_path_factory) -> dict:
    tmp = tmp_path_factory.mktemp("megatron_moe")
    path = save_tiny_moe(tmp / "model")
    samples = engine_samples(path)
    out: dict = {"path": path, "samples": samples}
    torch_backend = create_backend(path, TrainConfig(num_ranks=1, micro_batch_size=4, lr=LR),
                                   AlgoConfig(routing_replay=True), TEMPERATURE, seed=3)
    try:
        out["torch_step1"] = torch_backend.train_step(copy.deepcopy(samples), step=1)
        out["torch_step2"] = torch_backend.train_step(copy.deepcopy(samples), step=2)
    finally:
        torch_backend.shutdown()
    for tp, pack in ((1, True), (2, False)):
        b = create_backend(path, megatron_cfg(tp, pack), AlgoConfig(routing_replay=True), TEMPERATURE, seed=3)
        try:
            out[f"tp{tp}_logprobs"] = b.logprobs(samples)
            b.export_hf(str(tmp / f"export_tp{tp}"))
            out[f"tp{tp}_export"] = str(tmp / f"export_tp{tp}")
            out[f"tp{tp}_step1"] = b.train_step(copy.deepcopy(samples), step=1)
            out[f"tp{tp}_step2"] = b.train_step(copy.deepcopy(samples), step=2)
        finally:
            b.shutdown()
    return out


def test_moe_logprobs_match_hf_and_engine_at_tp1_and_tp2(runs):
    hf = load_causal_lm(runs["path"]).eval()
    samples = runs["samples"]
    with torch.no_grad():
        ref = response_logprobs(hf, collate(samples, pad_id=0), TEMPERATURE)
    for tp in (1, 2):
        got = runs[f"tp{tp}_logprobs"]
        assert [len(r) for r in got] == [len(s.response_ids) for s in samples]
        for i, row in enumerate(got):
            assert (torch.tensor(row) - ref[i, :len(row)]).abs().max().item() < 1e-5, (tp, i)
            assert (torch.tensor(row) - torch.tensor(samples[i].engine_logprobs)).abs().max().item() < 1e-5
    for a, b in zip(runs["tp1_logprobs"], runs["tp2_logprobs"]):
        assert (torch.tensor(a) - torch.tensor(b)).abs().max().item() < 1e-5


def test_moe_export_round_trips_bit_exact(runs):
    source = load_file(f"{runs['path']}/model.safetensors")
    for tp in (1, 2):
        exported = load_file(f"{runs[f'tp{tp}_export']}/model.safetensors")
        assert set(exported) == set(source)
        assert any(".mlp.experts." in k for k in source) and any(k.endswith("mlp.gate.weight") for k in source)
        for name, t in source.items():
            assert torch.equal(exported[name], t), (tp, name)


def test_moe_steps_match_the_torch_backend_at_tp1_and_tp2(runs):
    """Same loss and gradient norm (experts, router and all) as the torch backend, replaying."""
    for step in (1, 2):
        ref = runs[f"torch_step{step}"]
        for tp in (1, 2):
            got = runs[f"tp{tp}_step{step}"]
            assert got["train/loss"] == pytest.approx(ref["train/loss"], abs=1e-6), (tp, step)
            assert got["train/grad_norm"] == pytest.approx(ref["train/grad_norm"], rel=1e-4), (tp, step)
            assert got["routing/agreement"] == pytest.approx(ref["routing/agreement"], abs=0.02), (tp, step)


def test_replaying_the_engines_own_routes_agrees_fully(runs):
    for tp in (1, 2):
        m = runs[f"tp{tp}_step1"]
        assert m["routing/agreement"] == 1.0, tp
        assert m["routing/engine_logprob_diff_mean_replay"] < 1e-5, (tp, m)
        assert m["routing/engine_logprob_diff_mean_no_replay"] < 1e-5, (tp, m)
        assert m["train/engine_logprob_diff_max"] < 1e-4, (tp, m)


def test_moved_router_chooses_other_experts_and_replay_forces_the_recorded_ones(runs):
    for tp in (1, 2):
        m = runs[f"tp{tp}_step2"]
        assert m["routing/agreement"] < 0.99, (tp, m)  # the router moved: its own top-k differs
        gap_replay = m["routing/engine_logprob_diff_mean_replay"]
        gap_no_replay = m["routing/engine_logprob_diff_mean_no_replay"]
        assert abs(gap_no_replay - gap_replay) > 1e-4 * max(gap_replay, gap_no_replay), (tp, m)
    a, b = runs["tp1_step2"], runs["tp2_step2"]  # TP=2 replays like TP=1 (padded vs packed layout too)
    assert b["routing/agreement"] == pytest.approx(a["routing/agreement"], abs=0.02)
    for key in ("routing/engine_logprob_diff_mean_replay", "train/loss"):
        assert b[key] == pytest.approx(a[key], rel=1e-3, abs=1e-6), key
