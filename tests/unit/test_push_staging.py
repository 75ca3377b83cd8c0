"""Megatron's push staging at TP=1 (core/train/megatron/push_staging.py): views of the packed
parameters, q/k/v kept in one buffer at the same addresses push after push, buckets that are
each one storage. CPU: the layouts are the same on a GPU."""

from __future__ import annotations

import torch

from milepost.core.train.megatron.converter import mapping_for, to_hf
from milepost.core.train.megatron.model import ModelSpec
from milepost.core.train.megatron.push_staging import PushStaging, Source
from milepost.core.train.weight_sender import storage_groups
from milepost.core.weight_sync.packing import allocate_packed

SPEC = ModelSpec(model_type="qwen3", num_layers=2, hidden_size=8, num_heads=4, num_query_groups=2, head_dim=2,
                 ffn_hidden_size=12, vocab_size=30, padded_vocab_size=32, tie_embeddings=True, qkv_bias=False,
                 qk_layernorm=True, norm_eps=1e-6, rope_theta=1e4, max_position_embeddings=64)


def _sources() -> list[Source]:
    """Megatron's parameters of SPEC, packed in one buffer (as the worker packs them before DDP)."""
    h, d = SPEC.hidden_size, SPEC.head_dim
    shapes = [("embedding.word_embeddings.weight", (SPEC.padded_vocab_size, h))]
    for i in range(SPEC.num_layers):
        p = f"decoder.layers.{i}."
        shapes += [(p + "input_layernorm.weight", (h,)),
                   (p + "self_attention.linear_qkv.weight", ((SPEC.num_heads + 2 * SPEC.num_query_groups) * d, h)),
                   (p + "self_attention.q_layernorm.weight", (d,)), (p + "self_attention.k_layernorm.weight", (d,)),
                   (p + "self_attention.linear_proj.weight", (h, SPEC.num_heads * d)),
                   (p + "pre_mlp_layernorm.weight", (h,)), (p + "mlp.linear_fc1.weight", (2 * SPEC.ffn_hidden_size, h)),
                   (p + "mlp.linear_fc2.weight", (h, SPEC.ffn_hidden_size))]
    shapes.append(("decoder.final_layernorm.weight", (h,)))
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(shape)) for _, shape in shapes]
    values = [p.data for p in params]
    allocate_packed([(p, p.shape, p.dtype) for p in params])
    for p, v in zip(params, values):
        p.data.copy_(v)
    return [Source(name, mapping_for(name, SPEC), p) for (name, _), p in zip(shapes, params)]


def _copies(sources: list[Source]) -> dict[str, torch.Tensor]:
    return {n: t for s in sources for n, t in to_hf(s.mapping, [s.param.detach()], SPEC)}


def test_a_push_stages_views_and_q_k_v_in_one_kept_buffer_with_the_copies_values() -> None:
    sources = _sources()
    staging = PushStaging(sources, SPEC, gather=None)
    staged = staging.stage(None)
    assert staged.keys() == _copies(sources).keys()
    assert all(torch.equal(staged[n], t) for n, t in _copies(sources).items())
    params = sources[0].param.untyped_storage().data_ptr()
    qkv = {n for n in staged if any(f"self_attn.{p}_proj" in n for p in "qkv")}
    assert {n for n, t in staged.items() if t.untyped_storage().data_ptr() != params} == qkv
    assert len({staged[n].untyped_storage().data_ptr() for n in qkv}) == 1  # one kept buffer
    groups = storage_groups(list(staged.items()))
    assert [len(g) for g in groups] == [len(staged) - len(qkv), len(qkv)]  # a bucket is one storage


def test_a_later_push_writes_the_trained_weights_into_the_same_addresses() -> None:
    sources = _sources()
    staging = PushStaging(sources, SPEC, gather=None)
    first = {n: t.data_ptr() for n, t in staging.stage(None).items()}
    with torch.no_grad():
        for s in sources:  # an optimizer step, in place
            s.param.mul_(-2)
    bucket = {n for n in first if ".layers.1." in n}
    again = staging.stage(bucket)
    assert again.keys() == bucket  # a bucket's names only
    assert {n: t.data_ptr() for n, t in again.items()} == {n: first[n] for n in bucket}
    expected = _copies(sources)
    assert all(torch.equal(again[n], expected[n]) for n in bucket)
