"""Routing replay's megatron side without megatron: routes laid out in megatron's token order,
and the tap's top-k stand-in forcing recorded experts with current scores."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

from milepost.core.algo.routing_replay import encode_routes
from milepost.core.train.megatron.routing import MegatronRouteTap, micro_batch_routes
from milepost.core.types import Sample

LAYERS, TOP_K = 2, 2


def sample(prompt_len: int, response_len: int, first_expert: int) -> Sample:
    """Routes whose expert ids say which position they belong to: [p, l] = (first + p, l)."""
    n = prompt_len + response_len - 1
    routes = np.array([[[first_expert + p, layer] for layer in range(LAYERS)] for p in range(n)], dtype=np.int32)
    return Sample(prompt_index=0, group_index=0, prompt_ids=[2] * prompt_len, response_ids=[3] * response_len,
                  engine_logprobs=[0.0] * response_len, loss_mask=[1] * response_len, finish_reason="stop",
                  weight_version="0", label="", routed_experts=encode_routes(routes))


SAMPLES = [sample(2, 2, 100), sample(3, 1, 200)]  # 4 tokens each, 3 routed positions each


def test_packed_routes_follow_the_samples_back_to_back() -> None:
    got = micro_batch_routes(SAMPLES, packed=True, width=4, num_layers=LAYERS, top_k=TOP_K)
    assert got.shape == (LAYERS, 8, TOP_K)
    assert got[0, :, 0].tolist() == [100, 101, 102, -1, 200, 201, 202, -1]  # a sample's last token: none
    assert got[1, 5].tolist() == [201, 1]


def test_padded_routes_are_position_major_as_megatrons_s_b_order() -> None:
    short = sample(1, 1, 300)  # 2 tokens in a row of 4: two padding positions
    got = micro_batch_routes([SAMPLES[0], short], packed=False, width=4, num_layers=LAYERS, top_k=TOP_K)
    # hidden [s, b] flattened: position p of row i at p * 2 + i
    assert got[0, :, 0].tolist() == [100, 300, 101, -1, 102, -1, -1, -1]


class FakeRouter:
    def __init__(self) -> None:
        self.topk, self.router_replay = TOP_K, None
        self.config = type("C", (), {"num_moe_experts": 4})()


def test_tap_forces_recorded_experts_with_current_scores_and_counts_agreement() -> None:
    routers = [FakeRouter()]
    tap = MegatronRouteTap(routers)
    scores = torch.tensor([[4.0, 3.0, 2.0, 1.0], [1.0, 2.0, 3.0, 4.0], [0.0, 5.0, 1.0, 6.0]])
    def topk(s: torch.Tensor, k: int, num_groups: int | None = None, group_topk: int | None = None) -> Any:
        return torch.topk(s, k=k, dim=1)

    recorded = torch.tensor([[[1, 0], [2, 0], [-1, -1]]])  # token 0 agrees (as a set), token 1 not, 2 none
    with tap.replay(recorded, force=True):
        values, chosen = routers[0].router_replay.get_replay_topk(scores, TOP_K, None, None, topk)
    assert chosen.tolist() == [[1, 0], [2, 0], [3, 1]]
    assert values.tolist() == [[3.0, 4.0], [3.0, 1.0], [6.0, 5.0]]  # the current scores there
    assert tap.agreement() == (1, 2)
    with tap.replay(recorded, force=False):  # compare only: megatron's own choice
        _, chosen = routers[0].router_replay.get_replay_topk(scores, TOP_K, None, None, topk)
    assert chosen.tolist() == [[0, 1], [3, 2], [3, 1]] and tap.agreement() == (1, 2)
    _, chosen = routers[0].router_replay.get_replay_topk(scores, TOP_K, None, None, topk)  # outside: untouched
    assert chosen.tolist() == [[0, 1], [3, 2], [3, 1]] and tap.agreement() == (0, 0)


def test_tap_refuses_routes_of_another_model() -> None:
    tap = MegatronRouteTap([FakeRouter()])
    routes = torch.zeros(3, 5, TOP_K, dtype=torch.long)
    with pytest.raises(ValueError, match="do not fit this model"), tap.replay(routes):
        pass
    with pytest.raises(ValueError, match="name expert 7, the model has 4"), tap.replay(torch.full((1, 5, TOP_K), 7)):
        pass
