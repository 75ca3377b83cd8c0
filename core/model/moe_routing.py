"""Seeing and steering the top-k routers of a Hugging Face MoE model (Qwen3-MoE's `*TopKRouter`).

One `RouterTap` per model, installed on every router module in layer order. Each router
forward is the original computation (softmax over the router logits, top-k, renormalised
when `norm_topk_prob`), with two additions:

- every forward's chosen experts are kept (`take()`: [layers, tokens, top_k]), which is how
  the built-in engine captures routing in SGLang's format;
- `replay(indices)` forces the chosen experts where `indices[layer, token]` is >= 0 (the
  experts the engine chose when it sampled) and lets the router choose elsewhere (-1). The
  gate weights are always the CURRENT softmax at the chosen experts, so gradients still reach
  the router (routing replay as in slime/Miles: the choice is replayed, not the weights).
  `observe(indices)` only compares. Either way the tap counts how many recorded
  (token, layer) routes the router's own top-k agrees with, as sets (`agreement()`).

Not forcing, the tap computes what the original router computes bit for bit (the gathered
probabilities are the values torch.topk returns). Concurrency: a tap belongs to one thread
(the engine's scheduler thread, or one trainer rank).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor


def find_routers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The top-k router modules of `model` in layer order (none for a dense model)."""
    return [m for m in model.modules()
            if type(m).__name__.endswith("TopKRouter") and hasattr(m, "top_k") and hasattr(m, "weight")]


class RouterTap:
    def __init__(self, routers: list[torch.nn.Module]) -> None:
        if not routers:
            raise ValueError("RouterTap needs an MoE model (no top-k router module found)")
        self.routers = routers
        first: Any = routers[0]  # a top-k router (find_routers): top_k and num_experts are ints
        self.num_layers, self.top_k = len(routers), int(first.top_k)
        self.num_experts = int(first.num_experts)
        self._taken: list[Tensor | None] = [None] * self.num_layers
        self._recorded: Tensor | None = None  # [layers, tokens, top_k], -1 where none
        self._force = False
        self.num_agree, self.num_compared = 0, 0
        for layer, router in enumerate(routers):
            router.forward = self._make_forward(layer, router)  # instance attribute: this model only

    @classmethod
    def install(cls, model: torch.nn.Module) -> RouterTap | None:
        """A tap on `model`'s routers, or None when the model has none (dense)."""
        routers = find_routers(model)
        return cls(routers) if routers else None

    def _make_forward(self, layer: int, router: Any) -> Any:
        def forward(hidden_states: Tensor) -> tuple[Tensor, Tensor, Tensor]:
            hidden = hidden_states.reshape(-1, router.hidden_dim)
            logits = F.linear(hidden, router.weight)
            probs = torch.softmax(logits, dtype=torch.float, dim=-1)
            chosen = torch.topk(probs, router.top_k, dim=-1).indices
            chosen = self._route(layer, chosen)
            values = probs.gather(1, chosen)
            if router.norm_topk_prob:
                values = values / values.sum(dim=-1, keepdim=True)
            self._taken[layer] = chosen.detach()
            return logits, values.to(logits.dtype), chosen
        return forward

    def _route(self, layer: int, natural: Tensor) -> Tensor:
        """The experts this layer uses: the recorded ones where forced, else the router's own."""
        if self._recorded is None:
            return natural
        recorded = self._recorded[layer]
        if recorded.shape[0] != natural.shape[0]:
            raise ValueError(f"recorded routes cover {recorded.shape[0]} tokens, the forward has "
                             f"{natural.shape[0]} (routes must be laid out like the batch)")
        has = recorded[:, 0] >= 0
        same = (natural.sort(dim=-1).values == recorded.sort(dim=-1).values).all(dim=-1)
        self.num_agree += int((same & has).sum())
        self.num_compared += int(has.sum())
        if not self._force:
            return natural
        return torch.where(has.unsqueeze(-1), recorded, natural)

    def take(self) -> Tensor:
        """The experts every layer chose in the last forward: [layers, tokens, top_k] (int64)."""
        if any(t is None for t in self._taken):
            raise RuntimeError("no router ran since the last take(): was the forward an MoE forward?")
        out = torch.stack([t for t in self._taken if t is not None])
        self._taken = [None] * self.num_layers
        return out

    @contextmanager
    def replay(self, indices: Tensor, force: bool = True) -> Iterator[None]:
        """Within the block, forwards route token t of layer l to `indices[l, t]` where it is
        >= 0 (force), or only compare with it (force False). `indices`: [layers, tokens, top_k]."""
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

    def observe(self, indices: Tensor) -> Any:
        """`replay(indices, force=False)`: compare only."""
        return self.replay(indices, force=False)

    def agreement(self, reset: bool = True) -> tuple[int, int]:
        """(routes the router's own top-k agreed with, routes compared) since the last reset."""
        out = (self.num_agree, self.num_compared)
        if reset:
            self.num_agree, self.num_compared = 0, 0
        return out
