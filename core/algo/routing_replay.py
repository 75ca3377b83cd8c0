"""MoE routing replay: train with the experts the engine chose when it sampled.

Routes travel as SGLang returns them (`meta_info.routed_experts`): base64 of int32 shaped
`(positions, num_layers, top_k)`, where position p is the token the model ran on at p
(prompt tokens, then every response token but the last), so position p's routes produced
the logits that predict token p + 1. A `Sample` keeps them in `routed_experts` (one string:
it goes through the buffer, Ray and checkpoints as is).

Partial rollouts (core/partial_rollout.py): a continuation sends prompt + tokens so far
again, and its reply routes every position again under the new policy. Positions already
held keep the routes of the policy that generated from them (`merge_routes`), so each span
of a mixed-version sample keeps its own routes.

Trainer side (`RankReplay`, one per rank): the routes of a micro-batch are laid out like its
[B, W] input (-1 where none: padding, the last token), and the model's RouterTap forces them
(`algo.routing_replay: true`) or only compares with them (false). Both ways the step reports
the mean and max |trainer - engine| logprob over loss tokens WITH and WITHOUT replay (the
other one from one extra no-grad forward per micro-batch) and the router agreement: the
fraction of recorded (token, layer) routes the trainer's own top-k equals, as sets.
"""

from __future__ import annotations

import base64
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import numpy as np
import torch
from torch import Tensor

from milepost.core.model.moe_routing import RouterTap
from milepost.core.types import Sample

INT32_BYTES = 4
# Sums each micro-batch reports; the driver turns them into the means below (finish_metrics).
SUMS = ("routing/agree_routes", "routing/compared_routes", "routing/loss_tokens",
        "routing/absdiff_sum_replay", "routing/absdiff_sum_no_replay")


def encode_routes(routes: np.ndarray | Tensor) -> str:
    """base64 of int32, SGLang's `routed_experts` encoding."""
    array = routes.numpy() if isinstance(routes, Tensor) else routes
    return base64.b64encode(np.ascontiguousarray(array, dtype=np.int32).tobytes()).decode()


def decode_routes(text: str, num_layers: int, top_k: int) -> np.ndarray:
    """[positions, num_layers, top_k] int32 from SGLang's encoding; ValueError if it does not fit."""
    raw = base64.b64decode(text)
    per_position = num_layers * top_k * INT32_BYTES
    if len(raw) % per_position:
        raise ValueError(f"routed_experts of {len(raw)} bytes is not a whole number of positions of "
                         f"{num_layers} layers x top-{top_k}: routes from another model?")
    return np.frombuffer(raw, dtype=np.int32).reshape(-1, num_layers, top_k)


def merge_routes(held: bytes, reply: str, num_positions: int) -> bytes:
    """`held` (raw int32 routes of the positions already generated) extended by the positions
    of `reply` (one /generate answer routing `num_positions` positions from 0) that it lacks."""
    raw = base64.b64decode(reply) if reply else b""
    if num_positions <= 0 or not raw:
        return held
    if len(raw) % num_positions:
        raise RuntimeError(f"engine returned {len(raw)} bytes of routed_experts for {num_positions} positions")
    per_position = len(raw) // num_positions
    return held + raw[len(held) // per_position * per_position:] if per_position else held


def batch_routes(samples: list[Sample], width: int, num_layers: int, top_k: int) -> Tensor | None:
    """[num_layers, B * width, top_k] int64: sample i's position p at row i * width + p, -1
    where it has no route. None when no sample carries routes."""
    if not any(s.routed_experts for s in samples):
        return None
    out = torch.full((len(samples), width, num_layers, top_k), -1, dtype=torch.long)
    for i, s in enumerate(samples):
        if s.routed_experts:
            routes = torch.from_numpy(decode_routes(s.routed_experts, num_layers, top_k).copy())[:width]
            out[i, :routes.shape[0]] = routes
    return out.permute(2, 0, 1, 3).reshape(num_layers, len(samples) * width, top_k)


class RankReplay:
    """One trainer rank's routing replay (see the module docstring)."""

    def __init__(self, tap: RouterTap, force: bool) -> None:
        self.tap, self.force = tap, force

    @classmethod
    def attach(cls, module: torch.nn.Module, force: bool) -> RankReplay | None:
        """None for a dense model; `force` (algo.routing_replay) on a dense model is an error."""
        tap = RouterTap.install(module)
        if tap is None and force:
            raise ValueError("algo.routing_replay: true needs a mixture-of-experts model (no top-k router "
                             "found); set algo.routing_replay=false or use an MoE model")
        return None if tap is None else cls(tap, force)

    def routes(self, samples: list[Sample], batch: dict[str, Tensor]) -> Tensor | None:
        return batch_routes(samples, batch["input_ids"].shape[1], self.tap.num_layers, self.tap.top_k)

    def applied(self, routes: Tensor | None, force: bool | None = None) -> AbstractContextManager[None]:
        """The forward inside routes by `routes` (forced, or compared only)."""
        if routes is None:
            return nullcontext()
        return self.tap.replay(routes, force=self.force if force is None else force)

    def compare(self, logprobs: Tensor, batch: dict[str, Tensor], routes: Tensor,
                forward: Callable[[], Tensor]) -> dict[str, float]:
        """Metric sums of one micro-batch: `logprobs` [B, T] are the trained forward's;
        `forward()` computes them again with the other replay setting (no grad)."""
        agree, compared = self.tap.agreement()
        with torch.no_grad(), self.applied(routes, force=not self.force):
            other = forward()
        self.tap.agreement()  # the second forward's comparisons are not counted again
        mask = batch["loss_mask"].bool()
        replay, no_replay = (logprobs, other) if self.force else (other, logprobs)
        gaps = {name: (lp.detach() - batch["engine_logprobs"]).abs()[mask]
                for name, lp in (("replay", replay), ("no_replay", no_replay))}
        metrics = {"routing/agree_routes": float(agree), "routing/compared_routes": float(compared),
                   "routing/loss_tokens": float(mask.sum())}
        for name, gap in gaps.items():
            metrics[f"routing/absdiff_sum_{name}"] = float(gap.sum())
            metrics[f"routing/engine_logprob_diff_{name}_max"] = float(gap.max()) if gap.numel() else 0.0
        return metrics


def finish_metrics(metrics: dict[str, Any]) -> dict[str, Any]:
    """The step's routing metrics from the sums over micro-batches and ranks: agreement and
    the mean |trainer - engine| logprob with and without replay. Rows without routes pass."""
    if "routing/compared_routes" not in metrics:
        return metrics
    out = {k: v for k, v in metrics.items() if k not in SUMS}
    tokens = max(1.0, metrics["routing/loss_tokens"])
    out["routing/agreement"] = metrics["routing/agree_routes"] / max(1.0, metrics["routing/compared_routes"])
    out["routing/engine_logprob_diff_mean_replay"] = metrics["routing/absdiff_sum_replay"] / tokens
    out["routing/engine_logprob_diff_mean_no_replay"] = metrics["routing/absdiff_sum_no_replay"] / tokens
    return out
