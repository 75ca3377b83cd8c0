"""Causal attention over a packed (THD) micro-batch: sequences back to back, delimited by
cu_seqlens, each attending only to itself.

Why not one SDPA call per sequence (what `SDPAttention` did first): RL rows are short and a
packed micro-batch holds hundreds of them (gpu-arith: ~230 rows of ~18 tokens in 4096), so
the loop launched ~230 attention kernels per layer forward and as many backward, and its
`cu_seqlens.tolist()` synchronised the GPU in every layer. On the H100 that made a 76 M
model's step take 2.3-3.6 s (bench/results/gpu_arith_h100_run3.txt).

Two paths, the same numbers up to kernel rounding:
- `varlen`: torch's flash-attention varlen kernel (`torch.nn.attention.varlen`), one launch
  for the whole micro-batch. CUDA, bf16/fp16 only, and a torch that has it.
- `grouped`: sequences of equal length batched into one SDPA call per distinct length
  (a gather, the calls, one un-permute). Everywhere else: CPU, fp32, older torch. The
  grouping is computed once per micro-batch and kept on its PackedSeqParams (every layer
  shares it), so it synchronises once per micro-batch, not per layer.
Each rank reports its path at setup (`kernel_for`); the run_steps stage log shows it.
"""

from __future__ import annotations

import functools
import inspect
import itertools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

_GROUPS_ATTR = "_milepost_length_groups"
VARLEN, GROUPED = "flash varlen", "SDPA grouped by length"  # the two paths, as a rank reports them


@dataclass(frozen=True)
class LengthGroups:
    """Token indices of a packed batch grouped by sequence length: `gathers[i]` [n_i * L_i]
    are the tokens of the n_i sequences of length `lengths[i]`, in order; `unpermute` puts
    the concatenated group outputs back in packed order."""

    lengths: tuple[int, ...]
    gathers: tuple[Tensor, ...]
    unpermute: Tensor


def length_groups(cu_seqlens: Tensor) -> LengthGroups:
    """The grouping for sequences delimited by `cu_seqlens` (int [n + 1]), on its device."""
    cu: list[int] = cu_seqlens.tolist()
    by_length: dict[int, list[int]] = {}
    for start, end in itertools.pairwise(cu):
        if end > start:
            by_length.setdefault(end - start, []).append(start)
    lengths = tuple(sorted(by_length))
    order: list[Tensor] = []
    for length in lengths:
        starts = torch.tensor(by_length[length], dtype=torch.long)
        order.append((starts[:, None] + torch.arange(length)[None, :]).reshape(-1))
    device = cu_seqlens.device
    permutation = torch.cat(order) if order else torch.zeros(0, dtype=torch.long)
    unpermute = torch.empty_like(permutation)
    unpermute[permutation] = torch.arange(permutation.numel())
    return LengthGroups(lengths, tuple(o.to(device) for o in order), unpermute.to(device))


def cached_length_groups(packed_seq_params: Any) -> LengthGroups:
    """length_groups of a PackedSeqParams, computed at its first layer and kept on it."""
    groups = getattr(packed_seq_params, _GROUPS_ATTR, None)
    if groups is None:
        groups = length_groups(packed_seq_params.cu_seqlens_q)
        setattr(packed_seq_params, _GROUPS_ATTR, groups)
    return groups


def grouped_attention(query: Tensor, key: Tensor, value: Tensor, groups: LengthGroups, scale: float | None,
                      gqa: bool) -> Tensor:
    """query [t, heads, d], key/value [t, groups, d] -> [t, heads, d]: causal within each sequence."""
    outs = []
    for length, gather in zip(groups.lengths, groups.gathers):
        # [n * L, h, d] -> [n, h, L, d]
        q, k, v = (x.index_select(0, gather).unflatten(0, (-1, length)).transpose(1, 2)
                   for x in (query, key, value))
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=gqa)
        outs.append(o.transpose(1, 2).reshape(-1, *query.shape[1:]))
    return torch.cat(outs).index_select(0, groups.unpermute)


@functools.cache
def _varlen() -> Callable[..., Any] | None:
    """torch's varlen_attn bound to causal masking (torch 2.10 spells it is_causal, later
    torches window_size=(-1, 0)), or None where this torch has none."""
    try:
        from torch.nn.attention.varlen import varlen_attn as imported
    except ImportError:
        return None
    varlen_attn: Callable[..., Any] = imported  # its signature differs by torch version
    params = inspect.signature(varlen_attn).parameters
    if "window_size" in params:
        return functools.partial(varlen_attn, window_size=(-1, 0))
    if "is_causal" in params:
        return functools.partial(varlen_attn, is_causal=True)  # torch 2.10's spelling
    return None


def varlen_usable(query: Tensor) -> bool:
    return kernel_for(query.device, query.dtype) == VARLEN


def kernel_for(device: torch.device, dtype: torch.dtype) -> str:
    """Which path packed attention takes for activations of `dtype` on `device` (the rank
    reports it at setup: its log line is in the run_steps stage log)."""
    usable = device.type == "cuda" and dtype in (torch.bfloat16, torch.float16) and _varlen() is not None
    return VARLEN if usable else GROUPED


def varlen_attention(query: Tensor, key: Tensor, value: Tensor, cu_seqlens: Tensor, max_seqlen: int,
                     scale: float | None) -> Tensor:
    """The flash varlen kernel; grouped-query key/value heads are repeated to the query's
    (varlen_attn takes GQA only in torches newer than the lent GPU's 2.11)."""
    attend = _varlen()
    assert attend is not None, "varlen_usable() first"
    if key.shape[1] != query.shape[1]:
        repeat = query.shape[1] // key.shape[1]
        key, value = key.repeat_interleave(repeat, dim=1), value.repeat_interleave(repeat, dim=1)
    cu = cu_seqlens.to(torch.int32)
    out: Tensor = attend(query, key, value, cu, cu, max_seqlen, max_seqlen, scale=scale)
    return out


def packed_attention(query: Tensor, key: Tensor, value: Tensor, packed_seq_params: Any, scale: float | None,
                     gqa: bool) -> Tensor:
    """Causal attention of a packed micro-batch: query [t, heads, d] -> [t, heads, d]."""
    if varlen_usable(query):
        return varlen_attention(query, key, value, packed_seq_params.cu_seqlens_q,
                                int(packed_seq_params.max_seqlen_q), scale)
    return grouped_attention(query, key, value, cached_length_groups(packed_seq_params), scale, gqa)
