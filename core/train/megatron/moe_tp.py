"""MoE layers under tensor parallelism without sequence parallelism (CPU: no Transformer Engine).

megatron-core 0.16's `MoELayer` refuses to train at TP > 1 without sequence parallelism, and
sequence parallelism needs TE's norms and attention, which this backend does not use. The
refusal is about speed, not correctness: without it each TP rank holds ALL tokens of the
micro-batch (replicated), and the allgather token dispatcher gathers them over the TP group,
so the experts (weights sharded over the expert-TP group = the TP group) see every token TP
times, and the combine's reduce-scatter sums the partial outputs and hands each rank one
copy: the forward is exact (TP times the expert FLOPs; fine for the CPU models it serves).

Backward, each copy's output gradient is the full one (the loss is computed the same on every
TP rank), so:
- the input's gradient is exact (the gather's backward reduce-scatters: sum over the experts'
  shards of one copy's gradient);
- the router's is exact (its probabilities are gathered the same way);
- the experts' weight gradients are TP times too large (one full contribution per copy).
So the experts' gradients (`main_grad`) are scaled by 1 / TP after the step's reduction and
before the optimizer (and the gradient norm) sees them.
Checked by tests/integration/test_megatron_moe.py: TP=2 steps equal TP=1's (loss, grad norm).
"""

from __future__ import annotations

from typing import Any

import torch


class _OneRankGroup:
    """Stands in for the attention TP group in MoELayer's (speed-only) sequence-parallel check;
    MoELayer reads `attn_tp_group` nowhere else (megatron-core 0.16)."""

    def size(self) -> int:
        return 1


def allow_tp_without_sequence_parallel(chunks: list[Any], tensor_parallel: int) -> None:
    """Let the chunks' MoE layers train at TP > 1 with replicated tokens (module docstring)."""
    if tensor_parallel == 1:
        return
    from megatron.core.transformer.moe.moe_layer import MoELayer
    for chunk in chunks:
        for module in chunk.modules():
            if isinstance(module, MoELayer):
                module.attn_tp_group = _OneRankGroup()


def expert_params(chunks: list[Any]) -> list[Any]:
    """The routed experts' parameters of the chunks (megatron 0.16 keeps them in the dense
    gradient buffers when expert_parallel is 1, so buffer-level scaling cannot single them out)."""
    from megatron.core.transformer.moe.moe_layer import MoELayer
    return [p for chunk in chunks for m in chunk.modules() if isinstance(m, MoELayer)
            for p in m.experts.parameters()]


@torch.no_grad()
def scale_expert_grads(params: list[Any], tensor_parallel: int) -> None:
    """Expert gradients / TP: each TP rank ran the experts on TP copies of the tokens (module
    docstring). Call after the schedule's gradient reduction, before the optimizer step."""
    if tensor_parallel == 1:
        return
    for p in params:
        p.main_grad.mul_(1.0 / tensor_parallel)
