"""Fused elementwise pieces for the megatron backend without Transformer Engine.

With Transformer Engine, megatron fuses RoPE, RMSNorm and SwiGLU into single kernels; the
local (torch) layer spec runs each as a chain of eager ops, and at the hidden sizes of small
models those memory passes cost a sizeable share of a training step. Here the same math is
written once as plain torch functions and, on CUDA, compiled by `torch.compile` (inductor
fuses each into one or two kernels, forward and backward):

- RoPE: `rope_bshd` / `rope_thd` stand in for TE's `fused_apply_rotary_pos_emb(_thd)`, which
  megatron calls when `apply_rope_fusion` is set. The packed (THD) variant gathers each
  token's frequencies from cu_seqlens instead of looping over sequences.
- RMSNorm: `FusedRMSNorm` replaces megatron's torch norm (same parameter, same state dict) with
  Hugging Face's numerics (normalise in fp32, round to the model dtype, then scale).
- SwiGLU: megatron's own `bias_activation_fusion` path, whose kernels megatron compiles itself
  (`megatron.core.jit.jit_fuser` is `torch.compile`); GPU only, it would compile on CPU too.

On CPU (CI) the same functions run eagerly, so the CPU parity tests check the math that the
GPU compiles. `train.megatron.fuse: false` switches all of it off (megatron's unfused path).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

_compiled: dict[str, Callable[..., Any]] = {}


def _mark_dynamic(args: tuple[Any, ...]) -> None:
    """Every dim but the last (the hidden / head / vocab size) of the tensor arguments is a
    token or batch count that changes from step to step in RL: compile those dynamic from the
    first call, instead of once static and once more dynamic (each function's compiled
    variants are capped by torch._dynamo.config.recompile_limit; past it, it runs eagerly)."""
    for a in args:
        if isinstance(a, torch.Tensor) and not isinstance(a, torch.nn.Parameter):
            for dim in range(max(1, a.dim() - 1)):
                torch._dynamo.maybe_mark_dynamic(a, dim)


def compiled(fn: Callable[..., Any], backend: str = "inductor") -> Callable[..., Any]:
    """torch.compile(fn) (one per function and backend), with `_mark_dynamic` on its arguments."""
    key = f"{fn.__module__}.{fn.__qualname__}:{backend}"
    if key not in _compiled:
        # One function meets several input kinds (hidden vs q/k norms, grad and no-grad passes,
        # bf16 training and fp32 checks, packed and padded rows): dynamo's default cap of 8
        # variants per function was reached on the H200 and the rest ran eagerly.
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 32)
        inner = torch.compile(fn, backend=backend)

        def call(*args: Any) -> Any:
            _mark_dynamic(args)
            return inner(*args)
        _compiled[key] = call
    return _compiled[key]


def maybe_compiled(fn: Callable[..., Any], enabled: bool = True) -> Callable[..., Any]:
    """`fn` compiled (`compiled`) when enabled and CUDA is there, else `fn` itself (CPU: eager)."""
    return compiled(fn) if enabled and torch.cuda.is_available() else fn


def _rope(t: Tensor, freqs: Tensor) -> Tensor:
    """megatron's `_apply_rotary_pos_emb_bshd` (non-interleaved, mscale 1, rotary on the whole head)."""
    cos, sin = freqs.cos().to(t.dtype), freqs.sin().to(t.dtype)
    x1, x2 = torch.chunk(t, 2, dim=-1)
    return t * cos + torch.cat((-x2, x1), dim=-1) * sin


def rope_bshd(t: Tensor, freqs: Tensor, transpose_output_memory: bool = False, interleaved: bool = False,
              **_: Any) -> Tensor:
    """TE's `fused_apply_rotary_pos_emb` signature: t [s, b, h, d], freqs [s, 1, 1, d] (fp32)."""
    if interleaved or freqs.shape[-1] != t.shape[-1]:
        raise ValueError("the megatron backend's RoPE fusion covers non-interleaved RoPE on the whole head only; "
                         "set train.megatron.fuse false for this model")
    return maybe_compiled(_rope)(t, freqs)


def _token_positions(cu_seqlens: Tensor, total: int) -> Tensor:
    """Position of every token of a packed row inside its own sequence."""
    idx = torch.arange(total, device=cu_seqlens.device)
    cu = cu_seqlens.to(torch.long)
    seq = torch.searchsorted(cu[1:], idx, right=True)
    return idx - cu[seq]


def rope_thd(t: Tensor, cu_seqlens: Tensor, freqs: Tensor, cp_size: int = 1, cp_rank: int = 0, **_: Any) -> Tensor:
    """TE's `fused_apply_rotary_pos_emb_thd` signature: t [tokens, h, d], positions restarting at
    every cu_seqlens boundary (the numbers of megatron's per-sequence loop, in one pass)."""
    if cp_size != 1:
        raise ValueError("context_parallel > 1 is not supported by the megatron backend (see train.megatron)")
    if freqs.shape[-1] != t.shape[-1]:
        raise ValueError("the megatron backend's RoPE fusion covers RoPE on the whole head only; "
                         "set train.megatron.fuse false for this model")
    pos = _token_positions(cu_seqlens, t.shape[0])
    return maybe_compiled(_rope)(t, freqs.reshape(freqs.shape[0], 1, freqs.shape[-1])[pos])


def _rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """Hugging Face's RMSNorm (Qwen2/Qwen3/Llama): fp32 statistics, round, then scale."""
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * y.to(x.dtype)


class FusedRMSNorm(torch.nn.RMSNorm):
    """torch.nn.RMSNorm (same parameters) with `_rms_norm`, compiled on CUDA. Installed by
    swapping the class of megatron's built norm modules, so names and checkpoints do not change."""

    def forward(self, x: Tensor) -> Tensor:
        eps = self.eps if self.eps is not None else torch.finfo(x.dtype).eps
        return maybe_compiled(_rms_norm)(x, self.weight, eps)


def install_rope() -> None:
    """Make megatron's `apply_rope_fusion` path call `rope_bshd` / `rope_thd` (it looks them up
    as module globals of rope_utils, which are None without Transformer Engine)."""
    from megatron.core.models.common.embeddings import rope_utils
    if rope_utils.fused_apply_rotary_pos_emb is None:
        rope_utils.fused_apply_rotary_pos_emb = rope_bshd
    if rope_utils.fused_apply_rotary_pos_emb_thd is None:
        rope_utils.fused_apply_rotary_pos_emb_thd = rope_thd


def config_overrides(fuse: bool, on_cpu: bool) -> dict[str, bool]:
    """TransformerConfig flags for the fused path (installing the RoPE functions first)."""
    if not fuse:
        return {"apply_rope_fusion": False, "bias_activation_fusion": False}
    install_rope()
    return {"apply_rope_fusion": True, "bias_activation_fusion": not on_cpu}


def swap_norms(module: torch.nn.Module, dtype: torch.dtype, fuse: bool) -> None:
    """Cast every norm to the model dtype (megatron's torch norms ignore params_dtype, HF keeps
    them in the model dtype, and export must be exact); with `fuse`, use FusedRMSNorm."""
    for m in module.modules():
        if isinstance(m, (torch.nn.RMSNorm, torch.nn.LayerNorm)):
            m.to(dtype)
            if fuse and type(m) is torch.nn.RMSNorm and m.elementwise_affine:
                m.__class__ = FusedRMSNorm
