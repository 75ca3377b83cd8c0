"""HF <-> megatron weight conversion: layouts by hand, TP sharding both ways, architectures.

The last test builds real megatron-core GPTModels (Qwen3, Llama, Qwen3-MoE) in a child process
(one gloo rank: megatron's process groups are global state) and checks their logits against
the HF model's and that HF -> megatron -> HF is bit-exact for each.
"""

from __future__ import annotations

import multiprocessing as mp
import tempfile

import pytest
import torch

from milepost.core.train.megatron.converter import mapping_for, to_hf, to_megatron
from milepost.core.train.megatron.model import (
    ModelSpec,
    padded_vocab,
    spec_from_hf_config,
)


def spec(**kw) -> ModelSpec:
    base = dict(model_type="qwen2", num_layers=1, hidden_size=4, num_heads=4, num_query_groups=2, head_dim=1,
                ffn_hidden_size=4, vocab_size=5, padded_vocab_size=8, tie_embeddings=False, qkv_bias=True,
                qk_layernorm=False, norm_eps=1e-6, rope_theta=1e4, max_position_embeddings=16)
    base.update(kw)
    return ModelSpec(**base)


def test_qkv_is_fused_per_query_group():
    s = spec()
    # head_dim 1: q rows are heads 0..3, k and v rows are groups 0..1; values name their origin
    q = torch.tensor([[10.0], [11.0], [12.0], [13.0]])
    k = torch.tensor([[20.0], [21.0]])
    v = torch.tensor([[30.0], [31.0]])
    m = mapping_for("decoder.layers.0.self_attention.linear_qkv.weight", s)
    assert m.kind == "qkv" and m.hf_names == tuple(f"model.layers.0.self_attn.{p}_proj.weight" for p in "qkv")
    fused = to_megatron(m, [q, k, v], s, 0, 1)
    # group 0: q heads 0,1 then k0, v0; group 1: q heads 2,3 then k1, v1
    assert fused.flatten().tolist() == [10, 11, 20, 30, 12, 13, 21, 31]
    shards = [to_megatron(m, [q, k, v], s, r, 2) for r in range(2)]
    assert shards[1].flatten().tolist() == [12, 13, 21, 31]  # TP rank 1 holds whole group 1
    back = dict(to_hf(m, shards, s))
    assert torch.equal(back[m.hf_names[0]], q) and torch.equal(back[m.hf_names[1]], k)
    assert torch.equal(back[m.hf_names[2]], v)


def test_gated_mlp_shards_hold_gate_and_up_of_their_rows():
    s = spec()
    gate, up = torch.arange(8.0).reshape(4, 2), 100 + torch.arange(8.0).reshape(4, 2)
    m = mapping_for("decoder.layers.0.mlp.linear_fc1.weight", s)
    shards = [to_megatron(m, [gate, up], s, r, 2) for r in range(2)]
    assert torch.equal(shards[0], torch.cat([gate[:2], up[:2]]))
    assert torch.equal(shards[1], torch.cat([gate[2:], up[2:]]))
    back = dict(to_hf(m, shards, s))
    assert torch.equal(back["model.layers.0.mlp.gate_proj.weight"], gate)
    assert torch.equal(back["model.layers.0.mlp.up_proj.weight"], up)


@pytest.mark.parametrize("name,kind", [
    ("decoder.layers.0.self_attention.linear_proj.weight", "row"),
    ("decoder.layers.0.mlp.linear_fc2.weight", "row"),
    ("embedding.word_embeddings.weight", "vocab"),
    ("decoder.layers.0.input_layernorm.weight", "replicated"),
])
def test_round_trip_through_two_tp_shards(name, kind):
    s = spec()
    m = mapping_for(name, s)
    assert m.kind == kind
    full = torch.randn(5, 4) if kind == "vocab" else (torch.randn(4) if kind == "replicated" else torch.randn(4, 4))
    shards = [to_megatron(m, [full], s, r, 2) for r in range(2)]
    if kind == "vocab":  # padded to 8 rows with zeros, split 4 + 4
        assert [t.shape[0] for t in shards] == [4, 4] and torch.equal(shards[1][1:], torch.zeros(3, 4))
    if kind == "row":
        assert shards[0].shape == (4, 2)
    (hf_name, back), = to_hf(m, shards if kind != "replicated" else shards[:1], s)
    assert hf_name == m.hf_names[0] and torch.equal(back, full)


def test_tied_output_layer_reads_the_embedding():
    assert mapping_for("output_layer.weight", spec(tie_embeddings=True)).hf_names == ("model.embed_tokens.weight",)
    assert mapping_for("output_layer.weight", spec()).hf_names == ("lm_head.weight",)


def test_expert_names():
    m = mapping_for("decoder.layers.3.mlp.experts.local_experts.5.linear_fc1.weight", spec())
    assert m.kind == "fc1" and m.hf_names == ("model.layers.3.mlp.experts.5.gate_proj.weight",
                                              "model.layers.3.mlp.experts.5.up_proj.weight")
    assert mapping_for("decoder.layers.3.mlp.router.weight", spec()).hf_names == ("model.layers.3.mlp.gate.weight",)
    with pytest.raises(KeyError, match="no HF counterpart"):
        mapping_for("decoder.layers.0.mlp.shared_experts.linear_fc1.weight", spec())


def test_padded_vocab_does_not_depend_on_tp():
    assert padded_vocab(15, 1) == padded_vocab(15, 2) == padded_vocab(15, 8) == 128
    assert padded_vocab(151936, 4) == 151936


def test_unsupported_architecture_and_bad_tp_are_refused():
    from transformers import GPT2Config, Qwen2Config
    with pytest.raises(ValueError, match="unsupported architecture 'gpt2'.*supported: qwen2, qwen3, qwen3_moe, llama"):
        spec_from_hf_config(GPT2Config())
    with pytest.raises(ValueError, match="num_key_value_heads=2 .* not divisible by train.megatron.tensor_parallel=4"):
        spec_from_hf_config(Qwen2Config(num_attention_heads=4, num_key_value_heads=2, hidden_size=64), 4)


def _check_architectures(port: int, queue: mp.Queue) -> None:
    """Child process: GPTModel from each HF architecture vs the HF model; export vs source."""
    import os

    import torch.distributed as dist
    import transformers as T
    from megatron.core import parallel_state
    from safetensors.torch import load_file

    from milepost.core.config import MegatronConfig
    from milepost.core.train.megatron import cpu_compat
    from milepost.core.train.megatron.converter import iter_hf_tensors, load_hf_into
    from milepost.core.train.megatron.head import response_logits
    from milepost.core.train.megatron.model import build_gpt_model, transformer_config
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    common = dict(vocab_size=31, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  intermediate_size=96, rope_theta=1e6)
    cases = {
        "qwen3": (T.Qwen3Config, T.Qwen3ForCausalLM, dict(head_dim=32, tie_word_embeddings=False)),
        "llama": (T.LlamaConfig, T.LlamaForCausalLM, dict(tie_word_embeddings=False)),
        "qwen3_moe": (T.Qwen3MoeConfig, T.Qwen3MoeForCausalLM,
                      dict(head_dim=16, moe_intermediate_size=24, num_experts=4, num_experts_per_tok=2,
                           norm_topk_prob=True, mlp_only_layers=[1])),
    }
    results = {}
    with cpu_compat.activate():
        parallel_state.initialize_model_parallel(1, 1)
        cpu_compat.seed_rng_tracker(0)
        torch.manual_seed(0)
        for name, (cfg_cls, model_cls, extra) in cases.items():
            path = tempfile.mkdtemp()
            hf = model_cls(cfg_cls(**common, **extra)).float().eval()
            for p in hf.parameters():
                p.data.normal_(0, 0.1)  # HF inits norms to 1 and biases to 0: make every tensor count
            hf.save_pretrained(path)
            s = spec_from_hf_config(T.AutoConfig.from_pretrained(path), 1)
            model = build_gpt_model(s, transformer_config(s, MegatronConfig(), torch.float32, True)).eval()
            load_hf_into([model], path, s, 0, 1)
            ids = torch.randint(2, 31, (2, 9))
            pos = torch.arange(9).unsqueeze(0).expand(2, 9)
            with torch.no_grad():  # the model returns hidden states; the backend's head makes logits
                rows = torch.arange(2).unsqueeze(-1).expand(2, 9)
                got = response_logits(model, model(ids, pos, None), rows, pos, 31, 1)
                ref = hf(input_ids=ids, position_ids=pos).logits
            source = load_file(os.path.join(path, "model.safetensors"))
            exported = dict(iter_hf_tensors([model], s, lambda t: [t]))
            results[name] = {"logit_diff": float((got - ref).abs().max()), "logit_std": float(ref.std()),
                             "same_names": set(source) == set(exported),
                             "bit_exact": all(torch.equal(source[k], exported[k]) for k in source)}
    dist.destroy_process_group()
    queue.put(results)


def test_architectures_match_hf_and_round_trip():
    from milepost.core.train.torch_backend import _free_port
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=_check_architectures, args=(_free_port(), queue))
    proc.start()
    results = queue.get(timeout=240)
    proc.join(timeout=60)
    assert set(results) == {"qwen3", "llama", "qwen3_moe"}
    for name, r in results.items():
        assert r["logit_std"] > 0.01, name  # logits that carry signal
        assert r["logit_diff"] < 1e-5, (name, r)
        assert r["same_names"] and r["bit_exact"], (name, r)


@pytest.mark.parametrize("name", [
    "decoder.layers.0.self_attention.linear_proj.weight", "decoder.layers.0.mlp.linear_fc1.weight",
    "embedding.word_embeddings.weight", "decoder.layers.0.input_layernorm.weight",
    "decoder.layers.0.self_attention.linear_qkv.weight",
])
def test_views_at_tp1_give_the_copies_values_and_read_the_shard_where_the_layout_allows(name):
    s = spec()
    m = mapping_for(name, s)
    shape = {"vocab": (8, 4), "replicated": (4,), "fc1": (8, 4), "qkv": (8, 4)}.get(m.kind, (4, 4))
    shard = torch.randn(shape)
    copies = to_hf(m, [shard], s)
    views = to_hf(m, [shard], s, views=True)
    assert [n for n, _ in views] == [n for n, _ in copies]
    for (_, c), (_, v) in zip(copies, views):
        assert torch.equal(c, v) and v.is_contiguous()
        shares = v.untyped_storage().data_ptr() == shard.untyped_storage().data_ptr()
        assert shares == (m.kind != "qkv")  # q/k/v are strided in the fused tensor: copied
    for _, c in copies:  # the default stays what safetensors can write: no tensor shares the shard
        assert c.untyped_storage().data_ptr() != shard.untyped_storage().data_ptr() or m.kind == "replicated"


def test_views_write_q_k_v_into_the_last_pushs_tensors_where_they_fit():
    s = spec()
    m = mapping_for("decoder.layers.0.self_attention.linear_qkv.weight", s)
    first = dict(to_hf(m, [torch.randn(8, 4)], s, views=True))
    shard = torch.randn(8, 4)
    wrong = {m.hf_names[2]: torch.zeros(3, 4)}  # v kept at another shape: a new tensor
    again = dict(to_hf(m, [shard], s, views=True, reuse={**first, **wrong}))
    assert again[m.hf_names[0]] is first[m.hf_names[0]] and again[m.hf_names[1]] is first[m.hf_names[1]]
    assert again[m.hf_names[2]] is not first[m.hf_names[2]] and again[m.hf_names[2]].shape == (2, 4)
    expected = dict(to_hf(m, [shard], s))
    assert all(torch.equal(again[n], expected[n]) for n in m.hf_names)
