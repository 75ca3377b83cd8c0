"""packed_attention on CUDA: torch's flash varlen kernel (one launch per micro-batch) against
one SDPA call per sequence, in bf16, forward and backward; and that the GPU path really is
the varlen kernel (a torch without it falls back to the grouped path, which the CPU tests
hold to the per-sequence reference exactly).

Run through the device tool: `python -m pytest -q -m gpu tests/gpu/test_packed_attention_gpu.py`.
"""

from __future__ import annotations

import pytest
import torch

from milepost.core.train.megatron.packed_attention import packed_attention, varlen_usable
from tests.unit.test_packed_attention import per_sequence

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")]


class _Params:
    def __init__(self, cu: torch.Tensor) -> None:
        self.cu_seqlens_q, self.max_seqlen_q = cu, int((cu[1:] - cu[:-1]).max())


@pytest.mark.parametrize("kv_heads", [12, 4])
def test_varlen_matches_per_sequence_bf16(kv_heads):
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(9, 19, (230,), generator=g).tolist()  # gpu-arith's rows: ~230 a micro-batch
    t = sum(lengths)
    q, k, v = (torch.randn(t, h, 64, generator=g).to("cuda", torch.bfloat16).requires_grad_()
               for h in (12, kv_heads, kv_heads))
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    assert varlen_usable(q), f"torch {torch.__version__} has no usable varlen_attn on this GPU"
    gqa = kv_heads != 12
    got = packed_attention(q, k, v, _Params(cu), 0.125, gqa)
    want = per_sequence(q, k, v, lengths, 0.125, gqa)
    torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)
    w = torch.randn_like(want)
    for a, b in zip(torch.autograd.grad((got.float() * w).sum(), (q, k, v)),
                    torch.autograd.grad((want.float() * w).sum(), (q, k, v)), strict=True):
        torch.testing.assert_close(a, b, rtol=2e-2, atol=2e-2)
