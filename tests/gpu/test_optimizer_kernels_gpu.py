"""core/train/megatron/optimizer_kernels.py on CUDA: the gradient norm, scaling and copies run without
a single wait for the GPU (torch's sync debug mode raises on one), where megatron's Python
stand-in waits once per tensor; and the norm is megatron's stand-in's.

Run through the device tool: `python -m pytest -q -m gpu tests/gpu/test_optimizer_kernels_gpu.py`.
"""

from __future__ import annotations

import pytest
import torch

from milepost.core.train.megatron.optimizer_kernels import (
    foreach_copy_this_to_that,
    foreach_l2_norm,
    foreach_scale,
)

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")]


def cuda_grads() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [torch.randn(shape, generator=g).cuda() for shape in ((2048, 512), (512,), (6144, 2048), (3,))]


def test_norm_and_scale_never_wait_for_the_gpu() -> None:
    ts = cuda_grads()
    bf16 = [torch.empty_like(t, dtype=torch.bfloat16) for t in ts]
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        norm, _ = foreach_l2_norm(0, None, [ts], False)
        foreach_scale(0, None, [ts, ts], 0.5)
        foreach_scale(0, None, [ts, bf16], 1.0)
        copied = [torch.empty_like(t, dtype=torch.bfloat16) for t in ts]
        foreach_copy_this_to_that(ts, copied)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    expected = torch.cat([t.reshape(-1) for t in ts]).norm() * 2  # ts were halved after the norm
    torch.testing.assert_close(norm[0], expected, rtol=1e-5, atol=0)
    assert all(torch.equal(b, t.to(torch.bfloat16)) for t, b in zip(ts, bf16, strict=True))
    assert all(torch.equal(b, t.to(torch.bfloat16)) for t, b in zip(ts, copied, strict=True))


def test_megatrons_stand_in_waits_and_agrees() -> None:
    from megatron.core.utils import local_multi_tensor_l2_norm
    ts = cuda_grads()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        with pytest.raises(RuntimeError, match="synchroniz"):
            local_multi_tensor_l2_norm(0, None, [ts], False)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    theirs, _ = local_multi_tensor_l2_norm(0, None, [ts], False)
    ours, _ = foreach_l2_norm(0, None, [ts], False)
    torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=0)
