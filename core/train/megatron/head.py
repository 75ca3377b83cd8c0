"""The output layer and per-token logprobs/entropy, without full-vocabulary fp32 logits.

The model returns hidden states (`model.HiddenStatesGPTModel`); the loss applies the output
layer only at the positions that predict response tokens (prompt positions never needed
logits), and `logprobs_and_entropy` computes

    logp = log_softmax(logits.float() / T),  logprob = logp[target],
    entropy = -(exp(logp) * logp).sum(-1)

(train/logprobs.py's convention) a chunk of rows at a time. Its backward recomputes each
chunk from the saved model-dtype logits instead of keeping fp32 [tokens, vocab] tensors from
the forward, so the peak is one chunk: for a 151k vocabulary, 8k response tokens would
otherwise hold ~5 GB per fp32 copy and several copies. Forward and backward of a chunk are
compiled on CUDA (`fusions.maybe_compiled`): a few reductions over the chunk, no fp32 copies.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from milepost.core.train.megatron.fusions import maybe_compiled

CHUNK_ELEMENTS = 1 << 27  # fp32 elements of one chunk (512 MiB)


def _scaled(x: Tensor, temperature: float) -> Tensor:
    z = x.float()
    return z / temperature if temperature > 0 else z


def _chunk_forward(x: Tensor, target: Tensor, temperature: float) -> tuple[Tensor, Tensor]:
    logp = torch.log_softmax(_scaled(x, temperature), dim=-1)
    lp = logp.gather(-1, target.unsqueeze(-1)).squeeze(-1)
    entropy = -(logp.exp() * logp.clamp(min=torch.finfo(logp.dtype).min)).sum(-1)
    return lp, entropy


def _chunk_backward(x: Tensor, target: Tensor, entropy: Tensor, g_lp: Tensor, g_ent: Tensor | None,
                    temperature: float) -> Tensor:
    """d/dz of g_lp * logp[target] + g_ent * entropy, z = x / T:
    g_lp * (onehot - p) - g_ent * p * (logp + entropy); then through the 1/T scale."""
    logp = torch.log_softmax(_scaled(x, temperature), dim=-1)
    p = logp.exp()
    grad = -p * g_lp.unsqueeze(-1)
    if g_ent is not None:
        grad = grad - g_ent.unsqueeze(-1) * p * (logp + entropy.unsqueeze(-1))
    grad = grad.scatter_add(-1, target.unsqueeze(-1), g_lp.unsqueeze(-1))
    if temperature > 0:
        grad = grad / temperature
    return grad.to(x.dtype)


class _LogprobEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, logits: Tensor, target: Tensor, temperature: float,
                compiled: bool) -> tuple[Tensor, Tensor]:
        n, vocab = logits.shape
        rows = max(1, CHUNK_ELEMENTS // vocab)
        fwd = maybe_compiled(_chunk_forward, compiled)
        lp = torch.empty(n, dtype=torch.float32, device=logits.device)
        entropy = torch.empty_like(lp)
        for a in range(0, n, rows):
            lp[a:a + rows], entropy[a:a + rows] = fwd(logits[a:a + rows], target[a:a + rows], temperature)
        ctx.save_for_backward(logits, target, entropy)
        ctx.temperature, ctx.rows, ctx.compiled = temperature, rows, compiled
        ctx.set_materialize_grads(False)  # entropy unused by the loss (entropy_coef 0): g_ent is None
        return lp, entropy

    @staticmethod
    def backward(ctx: Any, g_lp: Tensor | None, g_ent: Tensor | None) -> tuple[Tensor | None, None, None, None]:
        logits, target, entropy = ctx.saved_tensors
        if g_lp is None and g_ent is None:
            return None, None, None, None
        if g_lp is None:
            g_lp = torch.zeros_like(entropy)
        bwd = maybe_compiled(_chunk_backward, ctx.compiled)
        grad = torch.empty_like(logits)
        rows = ctx.rows
        for a in range(0, logits.shape[0], rows):
            grad[a:a + rows] = bwd(logits[a:a + rows], target[a:a + rows], entropy[a:a + rows], g_lp[a:a + rows],
                                   None if g_ent is None else g_ent[a:a + rows], ctx.temperature)
        return grad, None, None, None


def logprobs_and_entropy(logits: Tensor, target_ids: Tensor, temperature: float,
                         compiled: bool = True) -> tuple[Tensor, Tensor]:
    """(logprobs, entropy), both [B, T] fp32, of full-vocabulary logits [B, T, V] (model dtype).
    `compiled`: compile the chunk kernels where CUDA is there (fusions.maybe_compiled)."""
    b, t, v = logits.shape
    lp, ent = _LogprobEntropy.apply(logits.reshape(b * t, v), target_ids.reshape(-1), float(temperature), compiled)
    return lp.view(b, t), ent.view(b, t)


def response_logits(model: Any, hidden: Tensor, pick_rows: Tensor, pick_cols: Tensor, vocab_size: int,
                    tp_size: int) -> Tensor:
    """Output-layer logits [B, T, vocab_size] at the positions predicting response tokens.
    `hidden` is the model's [s, b, h] output; `model` the GPTModel (or its DDP wrapper)."""
    from megatron.core.utils import unwrap_model
    gpt = unwrap_model(model)
    picked = hidden[pick_cols, pick_rows]  # [B, T, h]
    weight = gpt.shared_embedding_or_output_weight() if gpt.share_embeddings_and_output_weights else None
    logits, _ = gpt.output_layer(picked, weight=weight)  # [B, T, padded vocab / tp]
    if tp_size > 1:
        from megatron.core.tensor_parallel import (
            gather_from_tensor_model_parallel_region,
        )
        logits = gather_from_tensor_model_parallel_region(logits)
    return logits[..., :vocab_size]
