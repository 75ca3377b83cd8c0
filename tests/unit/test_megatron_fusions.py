"""The megatron backend's fused pieces (core/train/megatron/head.py, fusions.py) against the
plain computations they replace. CPU runs them eagerly; CUDA compiles the same functions."""

from __future__ import annotations

import torch

from milepost.core.algo.losses import entropy_from_logits
from milepost.core.train.megatron import fusions
from milepost.core.train.megatron.head import logprobs_and_entropy


def test_chunked_logprobs_and_entropy_match_autograd(monkeypatch):
    monkeypatch.setattr("milepost.core.train.megatron.head.CHUNK_ELEMENTS", 3 * 37)  # 3 rows a chunk, 7 chunks
    torch.manual_seed(0)
    padded = torch.randn(4, 5, 40, dtype=torch.float64, requires_grad=True)
    target = torch.randint(0, 37, (4, 5))
    g_lp, g_ent = torch.randn(4, 5, dtype=torch.float64), torch.randn(4, 5, dtype=torch.float64)
    for temperature in (0.7, 0.0):
        logits = padded[..., :37]  # the padded vocabulary is dropped by a slice, as in response_logits
        scaled = logits.float() / temperature if temperature > 0 else logits.float()
        ref_lp = torch.log_softmax(scaled, -1).gather(-1, target.unsqueeze(-1)).squeeze(-1)
        ref_ent = entropy_from_logits(scaled)
        ref_grad, = torch.autograd.grad((ref_lp * g_lp).sum() + (ref_ent * g_ent).sum(), padded, retain_graph=True)
        lp, ent = logprobs_and_entropy(logits, target, temperature)
        grad, = torch.autograd.grad((lp * g_lp).sum() + (ent * g_ent).sum(), padded)
        assert torch.allclose(lp, ref_lp.float(), atol=1e-6) and torch.allclose(ent, ref_ent.float(), atol=1e-6)
        assert torch.allclose(grad, ref_grad, atol=1e-6) and grad[..., 37:].abs().max() == 0
        lp_only, = torch.autograd.grad(logprobs_and_entropy(logits, target, temperature)[0].sum(), padded)
        ref_only, = torch.autograd.grad(ref_lp.sum(), padded)  # entropy unused: its gradient is skipped
        assert torch.allclose(lp_only, ref_only, atol=1e-6)


def test_rope_and_norm_match_megatron_unfused():
    from megatron.core.models.common.embeddings.rope_utils import (
        _apply_rotary_pos_emb_bshd,
    )
    torch.manual_seed(0)
    freqs = torch.randn(12, 1, 1, 16)
    t = torch.randn(12, 2, 3, 16)
    assert torch.equal(fusions.rope_bshd(t, freqs), _apply_rotary_pos_emb_bshd(t, freqs))
    lengths = [5, 3, 4]  # packed: positions restart at every sequence
    packed = torch.randn(sum(lengths), 3, 16)
    cu = torch.tensor([0, 5, 8, 12], dtype=torch.int32)
    want = torch.cat([_apply_rotary_pos_emb_bshd(x.unsqueeze(1), freqs[:len(x)]).squeeze(1)
                      for x in packed.split(lengths)])
    assert torch.equal(fusions.rope_thd(packed, cu, freqs), want)
    norm = torch.nn.RMSNorm(16, eps=1e-6)
    norm.weight.data.normal_()
    x = torch.randn(7, 2, 16)
    ref = norm(x)
    fusions.swap_norms(norm, torch.float32, fuse=True)
    assert type(norm) is fusions.FusedRMSNorm and torch.allclose(norm(x), ref, atol=1e-6)
