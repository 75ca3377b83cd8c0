"""Runs megatron-core on CPU (gloo) for CI: a small, isolated compatibility layer.

megatron-core assumes CUDA: it places tensors with `device="cuda"` / `torch.cuda.current_device()`,
synchronizes streams and seeds CUDA RNG trackers. On a machine without CUDA, `activate()`
redirects exactly those calls to the CPU; on a GPU machine it does nothing, so GPU runs use
megatron-core unmodified. Measured on megatron-core 0.16.1 (FACTS.md, "megatron-core on CPU").

What it changes, only while no CUDA device exists:
- `torch.cuda.current_device()` returns "cpu" and `torch.cuda.synchronize()` is a no-op
  (both are called unconditionally by schedules, optimizer and checkpointing code);
- a TorchFunctionMode rewrites `device="cuda"` arguments and `Tensor.cuda()` to the CPU;
- gradient clipping scales gradients without asserting they are CUDA tensors;
- the RNG tracker is created without CUDA seeding (`model_parallel_cuda_manual_seed`
  needs a CUDA generator; CPU runs use the default generator, seeded by the caller).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

_patched = False


def on_cpu() -> bool:
    return not torch.cuda.is_available()


def _to_cpu(device: Any) -> Any:
    if isinstance(device, torch.device) and device.type == "cuda":
        return torch.device("cpu")
    if isinstance(device, str) and device.startswith("cuda"):
        return "cpu"
    if isinstance(device, int) and not isinstance(device, bool):
        return "cpu"  # a CUDA ordinal (from torch.cuda.current_device() in megatron code)
    return device


class _CudaToCpu(TorchFunctionMode):
    """Rewrites device='cuda' keyword arguments and Tensor.cuda() to the CPU."""

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = dict(kwargs or {})
        if func is torch.Tensor.cuda:
            return args[0]
        if "device" in kwargs:
            kwargs["device"] = _to_cpu(kwargs["device"])
        if func is torch.Tensor.to and len(args) > 1:
            args = (args[0], _to_cpu(args[1])) + tuple(args[2:])
        return func(*args, **kwargs)


def _clip_grad_by_total_norm_cpu(parameters: Any, max_norm: float, total_norm: float,
                                 use_decoupled_grad: bool = False) -> None:
    """megatron's clip_grad_by_total_norm_fp32 without its `torch.cuda.FloatTensor` assert."""
    attr = "decoupled_grad" if use_decoupled_grad else "grad"
    clip_coeff = max_norm / (total_norm + 1.0e-6)
    if clip_coeff < 1.0:
        for p in parameters:
            g = getattr(p, attr, None)
            if g is not None:
                g.detach().mul_(clip_coeff)


def _patch_module_functions() -> None:
    global _patched
    if _patched:
        return
    from megatron.core.optimizer import optimizer as mcore_optimizer
    # megatron asks torch.cuda for the device and synchronizes; on CPU these answer instead
    torch.cuda.current_device = lambda: "cpu"  # type: ignore[assignment, return-value]  # a name, not an index
    torch.cuda.synchronize = lambda *a, **k: None
    mcore_optimizer.clip_grad_by_total_norm_fp32 = _clip_grad_by_total_norm_cpu
    _patched = True


def fill_te_gaps() -> None:
    """megatron-core 0.16 reads `moe_utils.te_general_gemm` even when Transformer Engine is
    absent (NameError in the MoE router). Define it as None so the torch path runs. Needed on
    any device without TE, so not tied to the CPU switch."""
    from megatron.core.transformer.moe import moe_utils
    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


@contextmanager
def activate() -> Iterator[None]:
    """Every megatron call of a CPU process runs inside this (a no-op when CUDA exists)."""
    fill_te_gaps()
    if not on_cpu():
        yield
        return
    _patch_module_functions()
    with _CudaToCpu():
        yield


def seed_rng_tracker(seed: int) -> None:
    """Megatron's TP RNG tracker: CUDA-seeded on GPU, plain (default generator) on CPU."""
    from megatron.core import tensor_parallel
    if on_cpu():
        tensor_parallel.random.initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)
    else:
        tensor_parallel.model_parallel_cuda_manual_seed(seed)
