"""Routed experts in SGLang's format, captured by the built-in engine (`--enable-return-routed-experts`).

SGLang returns, per output, `meta_info.routed_experts`: base64 of int32 shaped
`(prompt_len + output_len - 1 - routed_experts_start_len, num_layers, top_k)`: the experts
every layer chose for every token the model ran on (prompt tokens, then each sampled token
but the last, which is never fed back), from `routed_experts_start_len` on.

How the built-in engine gets there (generation.Generator calls `record` after every
forward): a prefill's left-padded rows keep their prompt positions only; a decode step's row
keeps its one position unless its sequence finished at this step (a finished row still runs
through that step's forward, but SGLang never forwards a last token).
"""

from __future__ import annotations

import base64
from typing import Any

import numpy as np
import torch

from milepost.core.model.moe_routing import RouterTap


def record(tap: RouterTap, seqs: list[Any], mask: torch.Tensor | None) -> None:
    """Append the last forward's routes to each of `seqs` (the batch's rows, in order).
    `mask`: the prefill's [B, W] attention mask (left padding), None for a decode step."""
    routes = tap.take()  # [layers, rows * width, top_k]
    layers, _, top_k = routes.shape
    rows = routes.view(layers, len(seqs), -1, top_k).permute(1, 2, 0, 3).to(torch.int32)  # [B, W, L, k]
    for i, s in enumerate(seqs):
        if mask is not None:
            s.routed_experts.append(rows[i, int(mask.shape[1] - mask[i].sum()):])
        elif s.finish_reason is None:
            s.routed_experts.append(rows[i])


def response_routes(s: Any, start_len: int) -> str:
    """`meta_info.routed_experts` of one finished sequence: base64 of int32
    (prompt + output - 1 - start_len, layers, top_k)."""
    if not s.routed_experts:  # never ran (aborted in the queue): no token was routed
        return ""
    routes = torch.cat(s.routed_experts)[:max(0, len(s.prompt_ids) + len(s.output_ids) - 1)][start_len:]
    return base64.b64encode(np.ascontiguousarray(routes.numpy(), dtype=np.int32).tobytes()).decode()


def check_start_len(body: dict, prompts: list[list[int]], enabled: bool) -> int | None:
    """The request's routed_experts_start_len when it asks for routes, else None; raises
    ValueError (a 400) for a request the engine cannot answer."""
    if not body.get("return_routed_experts"):
        return None
    if not enabled:
        raise ValueError("`return_routed_experts` needs the server started with --enable-return-routed-experts "
                         "(an MoE model); milepost adds it for MoE models")
    start = body.get("routed_experts_start_len", 0)
    if not isinstance(start, int) or isinstance(start, bool) or not 0 <= start <= min(len(p) for p in prompts):
        raise ValueError("`routed_experts_start_len` must be an int in [0, prompt length]")
    return start
