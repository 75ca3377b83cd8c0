"""core/train/megatron/optimizer_kernels.py: the foreach stand-ins for Apex's multi-tensor
kernels compute what megatron's Python stand-ins compute, without reading a value on the host,
and are installed only in place of megatron's stand-ins."""

from __future__ import annotations

import importlib

import pytest
import torch

from milepost.core.train.megatron.optimizer_kernels import (
    _BINDINGS,
    _COPY,
    foreach_copy_this_to_that,
    foreach_l2_norm,
    foreach_scale,
    use_fast_multi_tensor,
)


def grads(seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=g) for shape in ((64, 32), (32,), (7, 5, 3), (1,))]


def test_the_norm_is_the_l2_norm_of_all_tensors_together() -> None:
    ts = grads()
    norm, per_tensor = foreach_l2_norm(0, None, [ts], False)
    expected = torch.cat([t.reshape(-1) for t in ts]).norm()
    assert per_tensor is None and norm.shape == (1,) and norm.dtype == torch.float32
    torch.testing.assert_close(norm[0], expected, rtol=1e-6, atol=0)


def test_the_norm_matches_megatrons_stand_in() -> None:
    from megatron.core.utils import local_multi_tensor_l2_norm

    from milepost.core.train.megatron import cpu_compat
    ts = grads(1)
    with cpu_compat.activate():  # the stand-in puts its result on device="cuda"
        theirs, _ = local_multi_tensor_l2_norm(0, None, [ts], False)
    ours, _ = foreach_l2_norm(0, None, [ts], False)
    torch.testing.assert_close(ours, theirs.to(ours.device), rtol=1e-6, atol=0)


def test_the_norm_never_reads_a_value_on_the_host() -> None:
    """Meta tensors have no values: any host read raises. Megatron's stand-in reads one per
    tensor (on a GPU, a wait for the GPU each); ours goes through."""
    from megatron.core.utils import local_multi_tensor_l2_norm
    ts = [torch.empty(t.shape, device="meta") for t in grads()]
    norm, _ = foreach_l2_norm(0, None, [ts], False)
    assert norm.device.type == "meta" and norm.shape == (1,)
    with pytest.raises(RuntimeError, match="meta"):
        local_multi_tensor_l2_norm(0, None, [ts], False)


def test_scale_in_place_into_another_dtype_and_by_a_factor() -> None:
    ts = grads(2)
    before = [t.clone() for t in ts]
    foreach_scale(0, None, [ts, ts], 0.5)  # clipping: the same list twice
    for t, b in zip(ts, before, strict=True):
        torch.testing.assert_close(t, b * 0.5, rtol=0, atol=0)
    bf16 = [torch.zeros_like(t, dtype=torch.bfloat16) for t in ts]
    foreach_scale(0, None, [ts, bf16], 1.0)  # master weights into the bf16 parameters
    for t, b in zip(ts, bf16, strict=True):
        assert torch.equal(b, t.to(torch.bfloat16))
    out = [torch.empty_like(t) for t in ts]
    foreach_scale(0, None, [ts, out], 3.0)
    for t, o in zip(ts, out, strict=True):
        torch.testing.assert_close(o, t * 3.0, rtol=0, atol=0)


def test_the_master_weights_copy_into_bf16_parameters_as_copy_does() -> None:
    masters = grads(3)
    ours, theirs = ([torch.empty_like(t, dtype=torch.bfloat16) for t in masters] for _ in range(2))
    foreach_copy_this_to_that(masters, ours, None)
    for master, param in zip(masters, theirs, strict=True):  # megatron's loop for bf16 (no overflow_buf)
        param.copy_(master)
    assert all(torch.equal(a, b) for a, b in zip(ours, theirs, strict=True))
    foreach_copy_this_to_that([], [], None)  # no parameters: nothing to launch


def test_installed_only_over_megatrons_stand_ins(monkeypatch: pytest.MonkeyPatch) -> None:
    from megatron.core import utils as mcore_utils
    for module_name, name, fallback in _BINDINGS:  # as megatron binds them without Apex / TE
        monkeypatch.setattr(importlib.import_module(module_name), name, getattr(mcore_utils, fallback))
    def megatrons_copy(this: list[torch.Tensor], that: list[torch.Tensor], overflow_buf: object = None) -> None: ...
    megatrons_copy.__module__ = _COPY[0]  # as megatron's own function (an earlier test may have replaced it)
    optimizer = importlib.import_module(_COPY[0])
    monkeypatch.setattr(optimizer, _COPY[1], megatrons_copy)
    clip_grads = importlib.import_module("megatron.core.optimizer.clip_grads")

    replaced = use_fast_multi_tensor()
    assert replaced == [f"{m}.{n}" for m, n, _ in _BINDINGS] + [".".join(_COPY)]
    assert getattr(optimizer, _COPY[1]) is foreach_copy_this_to_that
    assert clip_grads.l2_norm_impl is foreach_l2_norm and clip_grads.multi_tensor_scale_impl is foreach_scale
    assert use_fast_multi_tensor() == []  # idempotent

    def apex_kernel(*args: object) -> None: ...
    monkeypatch.setattr(clip_grads, "l2_norm_impl", apex_kernel)
    use_fast_multi_tensor()
    assert clip_grads.l2_norm_impl is apex_kernel  # a real kernel is left alone
