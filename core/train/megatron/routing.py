"""MoE routing replay on the megatron backend: megatron-core's `TopKRouter`s forced to the
experts the engine chose (core/algo/routing_replay.py has the format and the metrics).

megatron-core 0.16 has a replay hook: `TopKRouter.router_replay`, whose `get_replay_topk`
`topk_routing_with_score_function` calls in place of its top-k. Its own `RouterReplay`
(`moe_enable_routing_replay`) does not fit: it keeps every router in a process-global list,
replaces the top-k of *every* token (our routes have none for padding and a sample's last
token) and never compares. So `MegatronRouteTap` puts one small object of its own in each
router's `router_replay` slot: it computes megatron's own top-k, counts how often it agrees
with the recorded routes, and where forcing, returns the recorded experts with their CURRENT
scores (`scores.gather`): for Qwen3-MoE (`norm_topk_prob`: top-k on the logits, softmax over
the k) that is the renormalised softmax at the forced experts, as the torch backend's tap
computes, so gradients still reach the router.

The tap has RouterTap's interface (`num_layers`, `top_k`, `replay(indices, force)`,
`agreement()`), so `routing_replay.RankReplay` drives it unchanged.

Token order: megatron's hidden states are [s, b, h] and the router flattens them to s * b + b,
so `micro_batch_routes` lays the routes out that way: packed micro-batches (b = 1) in packed
order, padded ones position-major. No sequence parallelism (refused): every TP rank routes
all tokens of the micro-batch, so every TP rank gets the same routes.

Concurrency: a tap belongs to one rank's thread. Activation recompute would re-run the router
outside the micro-batch's replay block, so replay with `recompute` other than none is refused.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor

from milepost.core.algo.routing_replay import batch_routes
from milepost.core.types import Sample

TopK = Callable[..., tuple[Tensor, Tensor]]


def find_megatron_routers(chunks: list[Any]) -> list[Any]:
    """The `TopKRouter`s of the model chunks, in layer order (none for a dense model)."""
    from megatron.core.transformer.moe.router import TopKRouter
    return [m for chunk in chunks for m in chunk.modules() if isinstance(m, TopKRouter)]


class _LayerReplay:
    """What megatron calls in place of its top-k for one router (its `router_replay` slot)."""

    def __init__(self, tap: MegatronRouteTap, layer: int) -> None:
        self.tap, self.layer = tap, layer

    def get_replay_topk(self, scores: Tensor, topk: int, num_groups: int | None = None,
                        group_topk: int | None = None, default_compute_topk: TopK | None = None
                        ) -> tuple[Tensor, Tensor]:
        assert default_compute_topk is not None
        values, natural = default_compute_topk(scores, topk, num_groups=num_groups, group_topk=group_topk)
        chosen = self.tap.route(self.layer, natural)
        if chosen is natural:
            return values, natural
        return scores.gather(1, chosen), chosen


class MegatronRouteTap:
    """Sees and steers the routers of one rank's model chunks (see the module docstring)."""

    def __init__(self, routers: list[Any]) -> None:
        if not routers:
            raise ValueError("MegatronRouteTap needs an MoE model (no TopKRouter found)")
        self.num_layers, self.top_k = len(routers), int(routers[0].topk)
        self.num_experts = int(routers[0].config.num_moe_experts)
        self._recorded: Tensor | None = None  # [layers, tokens, top_k], -1 where none
        self._force = False
        self.num_agree, self.num_compared = 0, 0
        for layer, router in enumerate(routers):
            if router.router_replay is not None:
                raise ValueError("moe_enable_routing_replay is on: milepost's tap replaces megatron's RouterReplay")
            router.router_replay = _LayerReplay(self, layer)

    @classmethod
    def install(cls, chunks: list[Any]) -> MegatronRouteTap | None:
        routers = find_megatron_routers(chunks)
        return cls(routers) if routers else None

    def route(self, layer: int, natural: Tensor) -> Tensor:
        """The experts this layer uses: the recorded ones where forced, else `natural` itself."""
        if self._recorded is None:
            return natural
        recorded = self._recorded[layer].to(natural.device)
        if recorded.shape[0] != natural.shape[0]:
            raise ValueError(f"recorded routes cover {recorded.shape[0]} tokens, the forward has "
                             f"{natural.shape[0]} (routes must be laid out like the micro-batch)")
        has = recorded[:, 0] >= 0
        same = (natural.sort(dim=-1).values == recorded.sort(dim=-1).values).all(dim=-1)
        self.num_agree += int((same & has).sum())
        self.num_compared += int(has.sum())
        if not self._force:
            return natural
        return torch.where(has.unsqueeze(-1), recorded, natural)

    @contextmanager
    def replay(self, indices: Tensor, force: bool = True) -> Iterator[None]:
        """Within the block, token t of layer l goes to `indices[l, t]` where it is >= 0 (force),
        or is only compared with it. `indices`: [layers, tokens, top_k]."""
        if tuple(indices.shape[::2]) != (self.num_layers, self.top_k):
            raise ValueError(f"routes of shape {tuple(indices.shape)} do not fit this model "
                             f"([{self.num_layers}, tokens, {self.top_k}])")
        if bool((indices >= self.num_experts).any()):
            raise ValueError(f"recorded routes name expert {int(indices.max())}, the model has "
                             f"{self.num_experts}: routes from another model?")
        self._recorded, self._force = indices.long(), force
        try:
            yield
        finally:
            self._recorded, self._force = None, False

    def agreement(self, reset: bool = True) -> tuple[int, int]:
        """(routes megatron's own top-k agreed with, routes compared) since the last reset."""
        out = (self.num_agree, self.num_compared)
        if reset:
            self.num_agree, self.num_compared = 0, 0
        return out


def micro_batch_routes(samples: list[Sample], packed: bool, width: int, num_layers: int,
                       top_k: int) -> Tensor | None:
    """[layers, tokens, top_k] in megatron's token order for a micro-batch of `samples`
    (`width`: its padded row length; packed: samples back to back). None without routes."""
    rows = batch_routes(samples, width, num_layers, top_k)  # sample i position p at i * width + p
    if rows is None:
        return None
    if packed:
        lengths = [len(s.prompt_ids) + len(s.response_ids) for s in samples]
        index = torch.cat([i * width + torch.arange(n) for i, n in enumerate(lengths)])
        return rows[:, index]
    b = len(samples)  # [s, b] flattened: position p of row i at p * b + i
    return rows.reshape(num_layers, b, width, top_k).transpose(1, 2).reshape(num_layers, width * b, top_k)


def check_replay_layout(force: bool, recompute: str, pipeline_parallel: int) -> None:
    """Refuse what replay does not handle yet, naming both fields and the fix."""
    if not force:
        return
    if recompute != "none":
        raise ValueError(f"algo.routing_replay: true with train.megatron.recompute={recompute} is not supported "
                         "(the recomputed forward would route without the recorded experts); set "
                         "train.megatron.recompute=none or algo.routing_replay=false")
    if pipeline_parallel > 1:
        raise ValueError(f"algo.routing_replay: true with train.megatron.pipeline_parallel={pipeline_parallel} is "
                         "not supported yet (routes are set per micro-batch on every layer of one stage); set "
                         "train.megatron.pipeline_parallel=1 or algo.routing_replay=false")
