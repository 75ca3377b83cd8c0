"""MoE routing: the built-in engine's capture in SGLang's format, and replay in a trainer forward."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

from milepost.core.algo.routing_replay import (
    RankReplay,
    batch_routes,
    decode_routes,
    encode_routes,
    finish_metrics,
    merge_routes,
)
from milepost.core.engine.generation import Generator, SamplingParams, make_sequences
from milepost.core.engine.routing_capture import check_start_len, response_routes
from milepost.core.model.moe_routing import RouterTap
from milepost.core.train.batch import collate
from milepost.core.train.logprobs import response_logprobs
from milepost.core.types import Sample

LAYERS, EXPERTS, TOP_K = 2, 4, 2
PROMPTS = [[5, 6, 7], [3, 9, 11, 12, 4, 8], [2, 3]]


@pytest.fixture(scope="module")
def model() -> Qwen3MoeForCausalLM:
    torch.manual_seed(0)
    cfg = Qwen3MoeConfig(vocab_size=32, hidden_size=32, intermediate_size=64, num_hidden_layers=LAYERS,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_experts=EXPERTS,
                         num_experts_per_tok=TOP_K, moe_intermediate_size=16, norm_topk_prob=True,
                         max_position_embeddings=64, eos_token_id=1, pad_token_id=0)
    m = Qwen3MoeForCausalLM(cfg).float().eval()
    for router in RouterTap.install(copy.deepcopy(m)).routers:  # just to find the names' shapes
        assert router.weight.shape == (EXPERTS, 32)
    with torch.no_grad():
        for layer in m.model.layers:  # a real routing choice, not the near-uniform init
            layer.mlp.gate.weight.normal_(0.0, 1.0)
    return m


def _engine_samples(model, temperature: float = 1.0) -> list[Sample]:
    """Generate with the engine's capture on, as the server does; one Sample per sequence."""
    engine_model = copy.deepcopy(model)
    gen = Generator(engine_model, eos_token_ids=[1])
    gen.route_tap = RouterTap.install(engine_model)
    params = SamplingParams(max_new_tokens=6, temperature=temperature, sampling_seed=4)
    seqs = [s for p in PROMPTS for s in make_sequences(p, params, 1)]
    assert gen.run_batch(seqs)
    return [Sample(prompt_index=i, group_index=i, prompt_ids=s.prompt_ids, response_ids=s.output_ids,
                   engine_logprobs=s.output_logprobs, loss_mask=[1] * len(s.output_ids), finish_reason="stop",
                   weight_version="0", label="", routed_experts=response_routes(s, 0))
            for i, s in enumerate(seqs)]


def test_engine_routes_have_sglangs_shape(model) -> None:
    samples = _engine_samples(model)
    for s in samples:  # (prompt + output - 1, layers, top_k), experts in range, distinct per token
        routes = decode_routes(s.routed_experts, LAYERS, TOP_K)
        assert routes.shape == (len(s.prompt_ids) + len(s.response_ids) - 1, LAYERS, TOP_K)
        assert routes.min() >= 0 and routes.max() < EXPERTS
        assert (routes[..., 0] != routes[..., 1]).all()


def test_replayed_engine_routes_reproduce_the_engines_logprobs(model) -> None:
    """A full trainer forward forced onto the engine's routes gives the engine's logprobs and
    the router agrees with every recorded route (same weights)."""
    samples = _engine_samples(model)
    trainer = copy.deepcopy(model)
    replay = RankReplay.attach(trainer, force=True)
    batch = collate(samples, pad_id=0)
    routes = replay.routes(samples, batch)
    with replay.applied(routes):
        lp = response_logprobs(trainer, batch, 1.0)
    mask = batch["loss_mask"].bool()
    assert (lp - batch["engine_logprobs"]).abs()[mask].max() < 1e-5
    agree, compared = replay.tap.agreement()
    assert compared == sum(len(s.prompt_ids) + len(s.response_ids) - 1 for s in samples) * LAYERS
    assert agree == compared


def test_untapped_and_unforced_forwards_are_bitwise_the_original(model) -> None:
    x = torch.tensor([[5, 6, 7, 8, 9]])
    plain = model(input_ids=x).logits
    tapped = copy.deepcopy(model)
    tap = RouterTap.install(tapped)
    assert torch.equal(tapped(input_ids=x).logits, plain)
    assert tap.take().shape == (LAYERS, 5, TOP_K)


def test_forced_routes_use_current_gate_probabilities_and_train_the_router(model) -> None:
    trainer = copy.deepcopy(model)
    tap = RouterTap.install(trainer)
    x = torch.tensor([[5, 6, 7, 8]])
    forced = torch.tensor([[3, 0]]).expand(LAYERS, 4, TOP_K)
    with tap.replay(forced):
        out = trainer(input_ids=x).logits
    assert torch.equal(tap.take(), forced)
    out.sum().backward()
    assert trainer.model.layers[0].mlp.gate.weight.grad.abs().sum() > 0
    router = tap.routers[0]
    hidden = torch.randn(3, 32)
    probs = torch.softmax(hidden @ router.weight.T, dim=-1)
    with tap.replay(torch.tensor([[3, 0]]).expand(LAYERS, 3, TOP_K)):
        _, values, _ = router(hidden)
    expected = probs[:, [3, 0]] / probs[:, [3, 0]].sum(-1, keepdim=True)
    torch.testing.assert_close(values, expected)


def test_routes_that_do_not_fit_the_model_are_refused(model) -> None:
    tap = RouterTap.install(copy.deepcopy(model))
    routes = torch.zeros(3, 4, TOP_K, dtype=torch.long)
    with pytest.raises(ValueError, match="do not fit this model"), tap.replay(routes):
        pass
    with pytest.raises(ValueError, match="another model"), tap.replay(torch.full((LAYERS, 4, TOP_K), EXPERTS)):
        pass
    with pytest.raises(ValueError, match="another model"):
        decode_routes(encode_routes(np.zeros((3, 3, 1))), LAYERS, TOP_K)


def test_batch_routes_lay_positions_out_like_the_batch() -> None:
    routes = np.arange(3 * LAYERS * TOP_K).reshape(3, LAYERS, TOP_K) % EXPERTS
    a = Sample(0, 0, [5, 6], [7, 8], [0.0, 0.0], [1, 1], "stop", "0", "", routed_experts=encode_routes(routes))
    b = Sample(1, 1, [5], [7], [0.0], [1], "stop", "0", "")  # no routes (a padding sample)
    out = batch_routes([a, b], width=4, num_layers=LAYERS, top_k=TOP_K).view(LAYERS, 2, 4, TOP_K)
    assert torch.equal(out[:, 0, :3], torch.from_numpy(routes).long().permute(1, 0, 2))
    assert (out[:, 0, 3] == -1).all() and (out[:, 1] == -1).all()
    assert batch_routes([b], 4, LAYERS, TOP_K) is None


def test_a_continued_response_keeps_the_routes_of_its_first_span() -> None:
    """Positions routed by the first policy keep those routes; the continuation adds the rest."""
    first = np.full((4, LAYERS, TOP_K), 1)  # prompt 3 + 2 tokens - 1
    again = np.full((6, LAYERS, TOP_K), 2)  # prompt 3 + 2 tokens + 2 new - 1, all re-routed
    held = merge_routes(b"", encode_routes(first), 4)
    merged = np.frombuffer(merge_routes(held, encode_routes(again), 6), np.int32).reshape(-1, LAYERS, TOP_K)
    assert merged.shape[0] == 6 and (merged[:4] == 1).all() and (merged[4:] == 2).all()
    with pytest.raises(RuntimeError, match="for 5 positions"):
        merge_routes(b"", encode_routes(first), 5)


def test_step_metrics_are_means_over_every_rank_and_micro_batch() -> None:
    sums = {"routing/agree_routes": 9.0, "routing/compared_routes": 10.0, "routing/loss_tokens": 4.0,
            "routing/absdiff_sum_replay": 4e-7, "routing/absdiff_sum_no_replay": 0.2, "train/loss": 1.0}
    out = finish_metrics(sums)
    assert out["routing/agreement"] == 0.9 and out["train/loss"] == 1.0
    assert out["routing/engine_logprob_diff_mean_replay"] == pytest.approx(1e-7)
    assert out["routing/engine_logprob_diff_mean_no_replay"] == pytest.approx(0.05)
    assert "routing/loss_tokens" not in out
    assert finish_metrics({"train/loss": 1.0}) == {"train/loss": 1.0}


def test_requests_for_routes_the_engine_cannot_answer_are_refused() -> None:
    assert check_start_len({}, [[1, 2]], enabled=False) is None
    with pytest.raises(ValueError, match="--enable-return-routed-experts"):
        check_start_len({"return_routed_experts": True}, [[1, 2]], enabled=False)
    with pytest.raises(ValueError, match="routed_experts_start_len"):
        check_start_len({"return_routed_experts": True, "routed_experts_start_len": 3}, [[1, 2]], enabled=True)
    assert check_start_len({"return_routed_experts": True, "routed_experts_start_len": 1}, [[1, 2]], True) == 1


def test_routing_replay_on_a_dense_model_is_refused() -> None:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from milepost.core.config import Recipe
    from milepost.core.errors import UserError
    from milepost.core.model.moe import check_routing_replay

    dense = Qwen2ForCausalLM(Qwen2Config(vocab_size=32, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                         num_attention_heads=4, num_key_value_heads=2))
    assert RankReplay.attach(dense, force=False) is None
    with pytest.raises(ValueError, match="algo.routing_replay"):
        RankReplay.attach(dense, force=True)
    with pytest.raises(UserError, match="algo.routing_replay.*builtin:tiny-arith-moe"):
        check_routing_replay(Recipe.model_validate({"algo": {"routing_replay": True}}))
    check_routing_replay(Recipe.model_validate({"algo": {"routing_replay": True},
                                                "model": {"path": "builtin:tiny-arith-moe"}}))
    check_routing_replay(Recipe.model_validate({"algo": {"routing_replay": True}, "train": {"backend": "megatron"},
                                                "model": {"path": "builtin:tiny-arith-moe"}}))


@pytest.mark.parametrize("megatron,match", [
    ({"pipeline_parallel": 2}, "train.megatron.pipeline_parallel=2 .*set train.megatron.pipeline_parallel=1 or "
                               "algo.routing_replay=false"),
    ({"recompute": "full"}, "train.megatron.recompute=full .*set train.megatron.recompute=none or "
                            "algo.routing_replay=false"),
])
def test_megatron_replay_refuses_what_it_does_not_handle(megatron, match) -> None:
    from milepost.core.config import Recipe
    from milepost.core.errors import UserError
    from milepost.core.model.moe import check_routing_replay
    recipe = {"algo": {"routing_replay": True}, "model": {"path": "builtin:tiny-arith-moe"},
              "train": {"backend": "megatron", "megatron": megatron}}
    with pytest.raises(UserError, match=match):
        check_routing_replay(Recipe.model_validate(recipe))
    recipe["algo"]["routing_replay"] = False  # without replay the routes are only compared
    check_routing_replay(Recipe.model_validate(recipe))


def test_a_saved_moe_checkpoint_loads_into_the_live_layout(model, tmp_path) -> None:
    """transformers saves experts one Linear each; the engine's disk update needs them fused."""
    from safetensors.torch import load_file

    from milepost.core.engine.disk_load import live_layout

    model.save_pretrained(tmp_path)
    raw = load_file(str(tmp_path / "model.safetensors"))
    assert "model.layers.0.mlp.experts.gate_up_proj" not in raw  # the per-expert hub layout
    state = live_layout(raw, model, str(tmp_path))
    own = model.state_dict()
    assert set(state) <= set(own) and all(torch.equal(state[k], own[k]) for k in state)
    assert live_layout(state, model, str(tmp_path)) is state  # already live: used as is


def test_a_partial_response_asks_for_routes_and_merges_its_continuations() -> None:
    from milepost.core.partial_rollout import PartialResponse
    from milepost.core.types import Prompt

    def answer(num_inputs: int, ids: list[int], version: str, expert: int, reason: str) -> dict:
        routes = np.full((num_inputs + len(ids) - 1, LAYERS, TOP_K), expert)
        return {"output_ids": ids, "meta_info": {"output_token_logprobs": [[-1.0, t, None] for t in ids],
                                                 "weight_version": version, "finish_reason": {"type": reason},
                                                 "routed_experts": encode_routes(routes)}}

    r = PartialResponse(Prompt(0, "", "", [5, 6, 7]), 0, seed=1, max_new_tokens=4, want_routes=True)
    r.absorb(answer(3, [8, 9], "1", expert=1, reason="abort"))  # cut by a push after 2 tokens
    r.absorb(answer(5, [10, 1], "2", expert=2, reason="stop"))  # continued: prompt + 2 tokens again
    routes = decode_routes(r.routes_text(), LAYERS, TOP_K)
    assert routes.shape[0] == 3 + 4 - 1 and r.spans == [[0, "1"], [2, "2"]]
    assert (routes[:4] == 1).all() and (routes[4:] == 2).all()  # position 4 (token 9) predicted token 10
    with pytest.raises(RuntimeError, match="sglang-router drops return_routed_experts"):
        PartialResponse(Prompt(0, "", "", [5]), 0, 1, 2, want_routes=True).absorb(
            {"output_ids": [3], "meta_info": {"output_token_logprobs": [[-1.0, 3, None]]}})
    assert PartialResponse(Prompt(0, "", "", [5]), 0, 1, 2).routes_text() is None
