"""The optimizer step's kernels where megatron-core runs without Transformer Engine or Apex (as
here: Transformer Engine does not install on these machines, ../shared/FACTS.md).

Without them megatron falls back to torch's foreach Adam and to Python stand-ins for Apex's
multi-tensor kernels (`megatron.core.utils.local_multi_tensor_*`). Three things cost a GPU
step more than their arithmetic:
- Adam: the foreach version makes several passes over the fp32 master weights and moments;
  torch's fused CUDA kernel makes one, as TE's FusedAdam does (`use_fused_adam`).
- The gradient norm (megatron's clip_grad): the stand-in takes one norm per parameter and
  builds a list of Python floats from them, one device-to-host copy each, so the host waits
  for the GPU once per parameter (Qwen3-1.7B: 226 waits a step,
  bench/results/fp8_profile_h100.txt, `cudaStreamSynchronize 232x`). A wait drains the
  queue of launched kernels: after it the GPU idles until the host has launched the next
  ones, and the step's host time can no longer hide behind the GPU's. `foreach_l2_norm`
  computes the same norm with torch's foreach norm and one reduction, on the device; the one
  wait left is megatron's own `.item()` of the total. `foreach_scale` does the same for the
  stand-in of Apex's multi_tensor_scale (gradient clipping): a few foreach launches instead of
  two kernels a parameter.
- The copy of the fp32 master weights into the bf16 parameters after each step: megatron copies
  parameter by parameter when training bf16 (Apex's kernel has no bf16 variant; one kernel and
  its host call each, 226 a step); `foreach_copy_this_to_that` copies them in a few launches.

`use_fast_multi_tensor()` installs these into megatron's optimizer modules in place of
megatron's own Python versions only (never over Apex's or TE's kernels). All run on CPU too, so
CPU tests train through the functions the GPU runs.
"""

from __future__ import annotations

import importlib
from typing import Any

import torch
from torch import Tensor

# megatron modules that bind the multi-tensor kernels at import time, and the names they bind
_BINDINGS = (("megatron.core.optimizer.clip_grads", "l2_norm_impl", "local_multi_tensor_l2_norm"),
             ("megatron.core.optimizer.clip_grads", "multi_tensor_scale_impl", "local_multi_tensor_scale"),
             ("megatron.core.optimizer.optimizer", "multi_tensor_scale_impl", "local_multi_tensor_scale"))


def foreach_l2_norm(chunk_size: int, noop_flag: Tensor | None, tensor_lists: list[list[Tensor]],
                    per_tensor: bool, *args: Any) -> tuple[Tensor, None]:
    """Apex's multi_tensor_l2norm signature: the l2 norm of all tensors of `tensor_lists`
    together, float32 [1] on their device, without waiting for the GPU. `per_tensor` norms are
    not returned (megatron asks for none)."""
    tensors = [t for tensor_list in tensor_lists for t in tensor_list]
    norms = torch._foreach_norm(tensors)
    total = torch.linalg.vector_norm(torch.stack(norms).float())
    return total.reshape(1), None


def foreach_scale(chunk_size: int, noop_flag: Tensor | None, tensor_lists: list[list[Tensor]],
                  scale: float) -> None:
    """Apex's multi_tensor_scale signature: dst = src * scale for tensor_lists = [src, dst]
    (the same list twice scales in place; dst may have another dtype)."""
    src, dst = tensor_lists[0], tensor_lists[1]
    if all(s is d for s, d in zip(src, dst, strict=True)):
        torch._foreach_mul_(dst, scale)
    elif scale == 1.0:
        torch._foreach_copy_(dst, src)
    else:
        torch._foreach_copy_(dst, torch._foreach_mul(src, scale))


def foreach_copy_this_to_that(this: list[Tensor], that: list[Tensor], overflow_buf: Tensor | None = None) -> None:
    """megatron's `_multi_tensor_copy_this_to_that`: that[i] = this[i], dtypes converted as
    `copy_` converts them, in a few launches whatever `overflow_buf` (Apex's flag) is."""
    if this:
        torch._foreach_copy_(that, this)


_REPLACEMENTS = {"local_multi_tensor_l2_norm": foreach_l2_norm, "local_multi_tensor_scale": foreach_scale}
_COPY = ("megatron.core.optimizer.optimizer", "_multi_tensor_copy_this_to_that")


def use_fast_multi_tensor() -> list[str]:
    """Put this module's functions in place of megatron's Python versions wherever megatron
    bound those; returns the `module.name`s replaced (no stand-in where Apex or TE is in use).
    Idempotent; process-wide (they are module globals)."""
    from megatron.core import utils as mcore_utils
    replaced = []
    for module_name, name, fallback in _BINDINGS:
        module = importlib.import_module(module_name)
        bound = getattr(module, name, None)
        if bound is getattr(mcore_utils, fallback, object()):
            setattr(module, name, _REPLACEMENTS[fallback])
            replaced.append(f"{module_name}.{name}")
    module = importlib.import_module(_COPY[0])
    copy = getattr(module, _COPY[1], None)
    if getattr(copy, "__module__", None) == _COPY[0]:  # megatron's own (a later megatron may rename it)
        setattr(module, _COPY[1], foreach_copy_this_to_that)
        replaced.append(".".join(_COPY))
    return replaced


def use_fused_adam(optimizer: Any) -> None:
    """Switch megatron's torch Adam(W) to torch's fused CUDA kernel (this module's docstring);
    CUDA only: torch's fused Adam has no CPU kernel in every torch this runs on."""
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = getattr(opt, "optimizer", None)
        if isinstance(inner, torch.optim.Adam):  # AdamW included
            for group in inner.param_groups:  # read by Adam.step; moment/step state is made lazily
                group["fused"], group["foreach"] = True, False
