"""core/train/megatron/step.py on CUDA: moving a micro-batch to the GPU does not wait for the
work already queued there (a copy from pageable host memory would: CUDA's rule).

Run through the device tool: `python -m pytest -q -m gpu tests/gpu/test_micro_batch_gpu.py`.
"""

from __future__ import annotations

import pytest
import torch

from milepost.core.train.megatron.step import build_micro_batches
from tests.gpu.test_megatron_gpu import make_samples

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")]


@pytest.mark.parametrize("pack", [True, False])
def test_a_micro_batch_moves_while_the_gpu_is_busy(pack: bool) -> None:
    (mb,) = build_micro_batches(make_samples(4, 0), 0, pack, 4, 4096)
    mb.to(torch.device("cuda"))  # as in training after the first step: the pinned buffers are cached
    torch.cuda.synchronize()
    torch.cuda._sleep(2_000_000_000)  # ~1 s of GPU cycles queued ahead of the copies
    moved = mb.to(torch.device("cuda"))
    assert not torch.cuda.current_stream().query(), "the move waited for the queued work"
    torch.cuda.synchronize()
    assert torch.equal(moved.input_ids.cpu(), mb.input_ids)
    assert all(torch.equal(moved.batch[k].cpu(), v) for k, v in mb.batch.items())
