"""Sampling on the model's device, batched, deterministic per sequence (the fast path's sampler).

A sequence's draw at output index i is a Gumbel race: argmax over the vocabulary of
logits / T + Gumbel noise, the noise of entry v a counter-based hash of (seed, i, v)
(`uniforms`, pure integer arithmetic: the same on CPU and CUDA). So its tokens do not
depend on what else is in the batch. A race is also robust to the last bits of the
logits, which do move with the batch's shape in bf16: a token changes only when the two
best scores are that close. (Inverse-CDF sampling, one uniform per row, changed every
sequence's tokens within a few steps: a flat 150 k-entry distribution moves its cumulative
sum by far more than one entry's width.) On CUDA the race is compiled (torch.compile) into
one kernel that reads the logits once; on CPU it runs eagerly. (The HF path,
generation.py, draws with a torch Generator per sequence: the two paths give different
samples for the same seed.)

Logprob convention (docs/CONTRACTS.md): the logprob of a token is log_softmax(logits / T)
at that token, taken before top-k / top-p / min-p truncation and before the
min_new_tokens stop mask; raw logits when T == 0 (greedy).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

log = logging.getLogger("milepost.engine")

_MASK32 = 0xFFFFFFFF
_GOLDEN = 0x9E3779B9
_MIX1, _MIX2 = 0x85EBCA6B, 0xC2B2AE35  # murmur3's finaliser constants
# Multipliers of the counters, below 2**31: a compiled kernel may hold a counter in int32
# and refuses larger literals beside it.
_INDEX_MUL, _VOCAB_MUL = 0x165667B1, 0x27D4EB2F


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """murmur3 fmix32 on int64 tensors holding 32-bit values. A product may wrap past 2**63;
    its low 32 bits, all that is kept, are exact either way."""
    x = x ^ (x >> 16)
    x = (x * _MIX1) & _MASK32
    x = x ^ (x >> 13)
    x = (x * _MIX2) & _MASK32
    return x ^ (x >> 16)


def uniforms(seeds: torch.Tensor, indices: torch.Tensor, vocab: torch.Tensor) -> torch.Tensor:
    """Uniforms in (0, 1), float32, one per (seed, index, vocabulary entry), broadcast.

    seeds: int64 (any 64-bit value); indices, vocab: int64 ≥ 0; e.g. [B, 1], [B, 1], [1, V]."""
    lo, hi = seeds & _MASK32, (seeds >> 32) & _MASK32
    x = _mix32(lo ^ _mix32(hi ^ _GOLDEN))
    x = _mix32(x ^ ((indices * _INDEX_MUL) & _MASK32))
    x = _mix32(x ^ ((vocab * _VOCAB_MUL) & _MASK32) ^ 0x5BD1E995)
    return ((x >> 8).float() + 0.5) / float(2**24)


def _race(scores: torch.Tensor, seeds: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """argmax(scores + Gumbel(seed, index, v)) per row; scores [B, V] → tokens [B]."""
    vocab = torch.arange(scores.shape[-1], device=scores.device).unsqueeze(0)
    u = uniforms(seeds.unsqueeze(-1), indices.unsqueeze(-1), vocab)
    return torch.argmax(scores - torch.log(-torch.log(u)), dim=-1)


_compiled_race = None


def race(scores: torch.Tensor, seeds: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """`_race`, compiled into one fused kernel on CUDA (compiled once, any batch size)."""
    global _compiled_race
    if scores.device.type != "cuda":
        return _race(scores, seeds, indices)
    if _compiled_race is None:
        _compiled_race = torch.compile(_race, dynamic=True)
    try:
        return _compiled_race(scores, seeds, indices)
    except Exception:  # same numbers eagerly, only slower: never fail a batch for the compiler
        log.exception("compiling the sampler failed; sampling eagerly from now on")
        _compiled_race = _race
        return _race(scores, seeds, indices)


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
    t = torch.where(p.temperature > 0, p.temperature, torch.ones_like(p.temperature)).unsqueeze(-1)
    scaled = logits.float() / t
    pick = scaled if blocked is None else scaled.masked_fill(blocked, float("-inf"))
    if p.needs_truncation:
        pick = truncate(torch.log_softmax(pick, dim=-1), p)
    drawn = race(pick, p.seed, indices)
    tokens = torch.where(p.temperature > 0, drawn, pick.argmax(-1))
    logprobs = scaled.gather(1, tokens.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(scaled, dim=-1)
    return tokens, logprobs
