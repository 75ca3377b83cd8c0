"""Sampling on the model's device, batched, deterministic per sequence (the fast path's sampler).

A sequence's draw at output index i uses one uniform number that depends only on its seed
and i (`row_uniforms`: a counter-based hash, the same on CPU and CUDA), and inverse-CDF
sampling over its own row of probabilities. So its tokens do not depend on what else is in
the batch, and the draw costs one cumulative sum instead of a noise value per vocabulary
entry. (The HF path, generation.py, draws differently — an exponential race with a torch
Generator per sequence; the two paths give different samples for the same seed.)

Logprob convention (docs/CONTRACTS.md): the logprob of a token is log_softmax(logits / T)
at that token, taken before top-k / top-p / min-p truncation and before the
min_new_tokens stop mask; raw logits when T == 0 (greedy).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

_MASK32 = 0xFFFFFFFF
_GOLDEN = 0x9E3779B9
_MIX1, _MIX2 = 0x85EBCA6B, 0xC2B2AE35  # murmur3's finaliser constants


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """murmur3 fmix32 on int64 tensors holding 32-bit values. A product may wrap past 2**63;
    its low 32 bits, all that is kept, are exact either way."""
    x = x ^ (x >> 16)
    x = (x * _MIX1) & _MASK32
    x = x ^ (x >> 13)
    x = (x * _MIX2) & _MASK32
    return x ^ (x >> 16)


def row_uniforms(seeds: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """One uniform in (0, 1) per row from (seed, output index); float64.

    seeds: [B] int64 (any 64-bit value); indices: [B] int64 ≥ 0. Pure integer arithmetic,
    so CPU and CUDA give the same numbers bit for bit."""
    lo, hi = seeds & _MASK32, (seeds >> 32) & _MASK32
    x = _mix32(lo ^ _mix32(hi ^ _GOLDEN))
    x = _mix32(x ^ ((indices * _GOLDEN) & _MASK32))
    y = _mix32(x ^ _MIX2)
    bits = (x << 21) ^ (y & 0x1FFFFF)  # 53 bits
    return (bits.double() + 0.5) / float(2**53)


@dataclass
class RowParams:
    """Sampling parameters of the rows, on the device. Shapes [B] unless said."""

    temperature: torch.Tensor  # float32; 0 means greedy
    top_k: torch.Tensor  # int64; ≤ 0 means off
    top_p: torch.Tensor  # float32; 1 means off
    min_p: torch.Tensor  # float32; 0 means off
    seed: torch.Tensor  # int64
    needs_truncation: bool  # any row with top-k, top-p or min-p (skips the sort otherwise)


def scaled_logprobs(logits: torch.Tensor, temperature: torch.Tensor) -> torch.Tensor:
    """log_softmax(logits / T) per row in float32, raw logits where T == 0. [B, V] → [B, V]."""
    t = torch.where(temperature > 0, temperature, torch.ones_like(temperature)).unsqueeze(-1)
    return torch.log_softmax(logits.float() / t, dim=-1)


def truncate(logprobs: torch.Tensor, p: RowParams) -> torch.Tensor:
    """Top-k, then top-p, then min-p, per row; masked entries become -inf. [B, V] → [B, V].
    The token that crosses top_p is kept (as generation._truncate)."""
    sorted_lp, order = torch.sort(logprobs, dim=-1, descending=True)
    rank = torch.arange(logprobs.shape[-1], device=logprobs.device).unsqueeze(0)
    k = torch.where(p.top_k > 0, p.top_k, torch.full_like(p.top_k, logprobs.shape[-1])).unsqueeze(-1)
    drop = rank >= k
    probs = sorted_lp.exp().masked_fill(drop, 0.0)
    before = torch.cumsum(probs, dim=-1) - probs  # mass of the better tokens
    drop |= before > p.top_p.unsqueeze(-1)
    floor = sorted_lp[:, :1] + torch.log(p.min_p.clamp(min=1e-38)).unsqueeze(-1)
    drop |= (sorted_lp < floor) & (p.min_p > 0).unsqueeze(-1)
    masked = sorted_lp.masked_fill(drop, float("-inf"))
    return torch.empty_like(logprobs).scatter_(-1, order, masked)


def sample(logits: torch.Tensor, p: RowParams, indices: torch.Tensor,
           blocked: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per row and its logprob.

    logits: [B, V]; indices: [B] int64, each row's output index (the draw's counter);
    blocked: [B, V] bool or None, tokens a row may not pick now (min_new_tokens' stop mask).
    Returns tokens [B] int64 and logprobs [B] float32 (the convention above)."""
    lp = scaled_logprobs(logits, p.temperature)
    pick = lp if blocked is None else lp.masked_fill(blocked, float("-inf"))
    greedy = pick.argmax(-1)
    if p.needs_truncation:
        pick = truncate(pick, p)
    probs = pick.exp()
    cdf = torch.cumsum(probs.double(), dim=-1)  # float64: the last entries of a 150 k-row sum stay exact
    target = row_uniforms(p.seed, indices) * cdf[:, -1]
    drawn = (cdf < target.unsqueeze(-1)).sum(-1).clamp(max=logits.shape[-1] - 1)
    tokens = torch.where(p.temperature > 0, drawn, greedy)
    return tokens, lp.gather(1, tokens.unsqueeze(-1)).squeeze(-1)
