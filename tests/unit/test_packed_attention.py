"""packed_attention's grouped path against one SDPA call per sequence (the reference: each
sequence of a packed batch attends causally to itself only), forward and backward."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from milepost.core.train.megatron.packed_attention import (
    cached_length_groups,
    grouped_attention,
    length_groups,
    packed_attention,
    varlen_usable,
)


def per_sequence(query, key, value, lengths, scale, gqa):
    outs = []
    for q, k, v in zip(*(x.split(lengths, dim=0) for x in (query, key, value)), strict=True):
        q, k, v = (t.transpose(0, 1).unsqueeze(0) for t in (q, k, v))
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=gqa)
        outs.append(o.squeeze(0).transpose(0, 1))
    return torch.cat(outs)


def packed(lengths, heads=4, kv_heads=4, dim=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    t = sum(lengths)
    q = torch.randn(t, heads, dim, generator=g, dtype=torch.float64, requires_grad=True)
    k = torch.randn(t, kv_heads, dim, generator=g, dtype=torch.float64, requires_grad=True)
    v = torch.randn(t, kv_heads, dim, generator=g, dtype=torch.float64, requires_grad=True)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    return q, k, v, cu


@pytest.mark.parametrize("lengths,kv_heads", [
    ([5, 3, 5, 1, 3, 5, 7], 4),   # repeated lengths in any order, a one-token sequence
    ([9], 2),                     # one sequence, grouped-query heads
    ([4, 0, 4, 6], 1),            # an empty sequence (cu_seqlens repeats a boundary)
])
def test_grouped_equals_one_call_per_sequence(lengths, kv_heads):
    q, k, v, cu = packed(lengths, kv_heads=kv_heads)
    gqa = kv_heads != q.shape[1]
    want = per_sequence(q, k, v, lengths, 0.3, gqa)
    got = grouped_attention(q, k, v, length_groups(cu), 0.3, gqa)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    weights = torch.randn_like(want)
    grads_want = torch.autograd.grad((want * weights).sum(), (q, k, v))
    grads_got = torch.autograd.grad((got * weights).sum(), (q, k, v))
    for a, b in zip(grads_got, grads_want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def test_no_attention_across_sequences():
    """Changing one sequence's keys changes no other sequence's output."""
    q, k, v, cu = packed([3, 4, 3])
    before = grouped_attention(q, k, v, length_groups(cu), None, False)
    k2 = k.detach().clone()
    k2[3:7] = torch.randn_like(k2[3:7])
    after = grouped_attention(q, k2, v, length_groups(cu), None, False)
    torch.testing.assert_close(after[:3], before[:3])
    torch.testing.assert_close(after[7:], before[7:])
    assert not torch.allclose(after[3:7], before[3:7])


def test_grouping_is_computed_once_per_micro_batch():
    """Every layer of a forward shares one PackedSeqParams: the grouping (and its one read of
    cu_seqlens) is kept on it."""

    class Params:
        def __init__(self, cu):
            self.cu_seqlens_q, self.max_seqlen_q = cu, int((cu[1:] - cu[:-1]).max())

    q, k, v, cu = packed([2, 5, 2])
    params = Params(cu)
    first = cached_length_groups(params)
    assert cached_length_groups(params) is first
    assert first.lengths == (2, 5)
    out = packed_attention(q.float(), k.float(), v.float(), params, None, False)
    assert out.shape == q.shape
    assert not varlen_usable(q.float())  # CPU: the grouped path


def test_the_path_a_rank_reports():
    from milepost.core.train.megatron.packed_attention import GROUPED, VARLEN, kernel_for

    assert kernel_for(torch.device("cpu"), torch.bfloat16) == GROUPED
    assert kernel_for(torch.device("cuda", 0), torch.float32) == GROUPED  # flash takes 16-bit only
    assert kernel_for(torch.device("cuda", 0), torch.bfloat16) == VARLEN  # this torch has varlen_attn
