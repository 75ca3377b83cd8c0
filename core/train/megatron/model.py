"""A megatron-core `GPTModel` built from a Hugging Face config (Qwen2, Qwen3, Qwen3-MoE, Llama).

`ModelSpec` is the one place that reads the HF config: the model builder and the weight
converter both take it, so their idea of the architecture (heads, groups, vocabulary padding,
tied embeddings, experts) cannot drift apart. The layer spec is megatron-core's local (non
Transformer Engine) spec with its core attention replaced by `SDPAttention`, torch's fused
scaled-dot-product attention: Transformer Engine is not installed on the test machines;
`fusions` stands in for TE's fused RoPE / RMSNorm / SwiGLU.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from milepost.core.train.megatron import fusions
from milepost.core.train.megatron.packed_attention import packed_attention

SUPPORTED_ARCHITECTURES = ("qwen2", "qwen3", "qwen3_moe", "llama")


@dataclass(frozen=True)
class ModelSpec:
    """The architecture facts megatron and the converter need, read from an HF config."""

    model_type: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_query_groups: int
    head_dim: int
    ffn_hidden_size: int
    vocab_size: int  # the HF vocabulary
    padded_vocab_size: int  # see padded_vocab(); extra rows are zeros that logprobs never read
    tie_embeddings: bool
    qkv_bias: bool
    qk_layernorm: bool
    norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    num_experts: int | None = None
    moe_topk: int = 0
    moe_ffn_hidden_size: int = 0
    moe_pre_softmax: bool = False
    moe_layer_pattern: tuple[int, ...] = ()  # 1 = MoE layer, 0 = dense layer
    init_std: float = 0.02

    def is_moe_layer(self, layer: int) -> bool:
        return bool(self.num_experts) and self.moe_layer_pattern[layer] == 1


def _rope_theta(cfg: Any) -> float:
    params = getattr(cfg, "rope_parameters", None) or {}
    rope_type = params.get("rope_type", "default")
    if rope_type != "default":
        raise ValueError(f"rope_type {rope_type!r} is not supported by the megatron backend (only 'default'); "
                         "use train.backend=torch for this model")
    return float(params.get("rope_theta", getattr(cfg, "rope_theta", 10000.0)))


VOCAB_DIVISOR = 128


def padded_vocab(vocab_size: int, tensor_parallel: int) -> int:
    """The vocabulary rounded up to a multiple of 128 (and of the TP size): the same padded
    size for every power-of-two TP, so a dist checkpoint's embedding shape does not depend on
    the TP it was written at (it must not: checkpoints reshard across TP sizes)."""
    divisor = math.lcm(VOCAB_DIVISOR, tensor_parallel)
    return -(-vocab_size // divisor) * divisor


def spec_from_hf_config(cfg: Any, tensor_parallel: int = 1) -> ModelSpec:
    """Read an HF `PretrainedConfig`; unsupported architectures raise naming the supported ones."""
    model_type = getattr(cfg, "model_type", "?")
    if model_type not in SUPPORTED_ARCHITECTURES:
        raise ValueError(f"unsupported architecture {model_type!r} for train.backend=megatron; supported: "
                         f"{', '.join(SUPPORTED_ARCHITECTURES)} (or use train.backend=torch)")
    heads = cfg.num_attention_heads
    groups = getattr(cfg, "num_key_value_heads", None) or heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    for what, n in (("num_attention_heads", heads), ("num_key_value_heads", groups)):
        if n % tensor_parallel:
            raise ValueError(f"{what}={n} of {model_type} is not divisible by train.megatron.tensor_parallel="
                             f"{tensor_parallel}; pick a tensor_parallel that divides {n}")
    if getattr(cfg, "mlp_bias", False):
        raise ValueError("llama with mlp_bias=true is not supported by the megatron backend")
    if model_type == "llama" and getattr(cfg, "attention_bias", False):
        raise ValueError("llama with attention_bias=true is not supported by the megatron backend")
    if getattr(cfg, "hidden_act", "silu") != "silu":
        raise ValueError(f"hidden_act {cfg.hidden_act!r} is not supported by the megatron backend (only silu)")
    moe: dict[str, Any] = {}
    if model_type == "qwen3_moe":
        sparse = [0 if (i in (cfg.mlp_only_layers or []) or (i + 1) % cfg.decoder_sparse_step) else 1
                  for i in range(cfg.num_hidden_layers)]
        moe = dict(num_experts=cfg.num_experts, moe_topk=cfg.num_experts_per_tok,
                   moe_ffn_hidden_size=cfg.moe_intermediate_size, moe_pre_softmax=not cfg.norm_topk_prob,
                   moe_layer_pattern=tuple(sparse))
    vocab = cfg.vocab_size
    return ModelSpec(
        model_type=model_type, num_layers=cfg.num_hidden_layers, hidden_size=cfg.hidden_size,
        num_heads=heads, num_query_groups=groups, head_dim=head_dim, ffn_hidden_size=cfg.intermediate_size,
        vocab_size=vocab, padded_vocab_size=padded_vocab(vocab, tensor_parallel),
        tie_embeddings=bool(getattr(cfg, "tie_word_embeddings", False)),
        qkv_bias=model_type == "qwen2", qk_layernorm=model_type in ("qwen3", "qwen3_moe"),
        norm_eps=float(cfg.rms_norm_eps), rope_theta=_rope_theta(cfg),
        max_position_embeddings=int(cfg.max_position_embeddings),
        init_std=float(getattr(cfg, "initializer_range", 0.02)), **moe)


def sdpa_attention_class() -> type:
    """`DotProductAttention` with torch's fused SDPA; packed (THD) batches through packed_attention."""
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    class SDPAttention(DotProductAttention):
        def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask: Any,
                    attn_mask_type: Any = None, attention_bias: Any = None,
                    packed_seq_params: Any = None) -> torch.Tensor:
            assert attention_bias is None, "attention bias is not supported"
            gqa = self.num_attention_heads_per_partition != self.num_query_groups_per_partition
            if packed_seq_params is not None:  # [t, heads, dim], sequences delimited by cu_seqlens
                out = packed_attention(query, key, value, packed_seq_params, self.softmax_scale, gqa)
                return out.reshape(out.shape[0], -1)
            # [s, b, heads, dim] -> [b, heads, s, dim]; right padding only, so causal is exact
            q, k, v = (x.permute(1, 2, 0, 3) for x in (query, key, value))
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.softmax_scale, enable_gqa=gqa)
            return o.permute(2, 0, 1, 3).reshape(o.shape[2], o.shape[0], -1)

    return SDPAttention


def transformer_config(spec: ModelSpec, layout: Any, dtype: torch.dtype, on_cpu: bool) -> Any:
    """megatron's TransformerConfig for `spec` under the parallel `layout` (MegatronConfig)."""
    from megatron.core.transformer.transformer_config import TransformerConfig
    # dense models: megatron checks the (unused) dispatcher against variable_seq_lengths
    moe: dict[str, Any] = {"moe_token_dispatcher_type": "alltoall"}
    if spec.num_experts:
        if on_cpu and layout.pipeline_parallel > 1:
            raise ValueError("MoE models with pipeline_parallel > 1 need the alltoall token dispatcher, which "
                             "needs CUDA; on CPU use train.megatron.pipeline_parallel 1")
        moe = dict(num_moe_experts=spec.num_experts, moe_router_topk=spec.moe_topk,
                   moe_ffn_hidden_size=spec.moe_ffn_hidden_size, moe_router_pre_softmax=spec.moe_pre_softmax,
                   moe_layer_freq=list(spec.moe_layer_pattern), moe_grouped_gemm=False,
                   # alltoall needs CUDA streams; allgather runs on CPU (and with pipeline_parallel 1)
                   moe_token_dispatcher_type="allgather" if on_cpu else "alltoall",
                   moe_router_load_balancing_type="none",
                   moe_router_dtype="fp32")
    recompute = {} if layout.recompute == "none" else (
        {"recompute_granularity": "selective"} if layout.recompute == "selective" else
        {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1})
    return TransformerConfig(
        num_layers=spec.num_layers, hidden_size=spec.hidden_size, num_attention_heads=spec.num_heads,
        num_query_groups=spec.num_query_groups, kv_channels=spec.head_dim, ffn_hidden_size=spec.ffn_hidden_size,
        normalization="RMSNorm", layernorm_epsilon=spec.norm_eps, gated_linear_unit=True, activation_func=F.silu,
        add_bias_linear=False, add_qkv_bias=spec.qkv_bias, qk_layernorm=spec.qk_layernorm,
        hidden_dropout=0.0, attention_dropout=0.0, init_method_std=spec.init_std,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False, gradient_accumulation_fusion=False, persist_layer_norm=False,
        params_dtype=dtype, bf16=dtype == torch.bfloat16, pipeline_dtype=dtype,
        use_cpu_initialization=on_cpu,
        tensor_model_parallel_size=layout.tensor_parallel, pipeline_model_parallel_size=layout.pipeline_parallel,
        virtual_pipeline_model_parallel_size=layout.virtual_pipeline,
        context_parallel_size=layout.context_parallel, expert_model_parallel_size=layout.expert_parallel,
        expert_tensor_parallel_size=layout.expert_tensor_parallel or layout.tensor_parallel,
        sequence_parallel=layout.sequence_parallel,
        **fusions.config_overrides(layout.fuse, on_cpu),
        # rollout micro-batches differ in length: pipeline stages must send their shapes
        variable_seq_lengths=layout.pipeline_parallel > 1,
        calculate_per_token_loss=True,  # the loss is pre-normalized by the step's token count
        **recompute, **moe)


def layer_spec(spec: ModelSpec, config: Any) -> Any:
    """The local layer spec (or block spec for MoE) with SDPA core attention."""
    from megatron.core.models.gpt.gpt_layer_specs import (
        get_gpt_decoder_block_spec,
        get_gpt_layer_local_spec,
    )
    attention = sdpa_attention_class()
    if spec.num_experts:
        block = get_gpt_decoder_block_spec(config, use_transformer_engine=False, normalization="RMSNorm")
        for layer in block.layer_specs:
            layer.submodules.self_attention.submodules.core_attention = attention
        return block
    layer = get_gpt_layer_local_spec(qk_layernorm=spec.qk_layernorm, normalization="RMSNorm")
    layer.submodules.self_attention.submodules.core_attention = attention
    return layer


@functools.cache
def hidden_states_gpt_model_class() -> type:
    """megatron's GPTModel, returning the last stage's final hidden states [s, b, h] instead of
    logits: the loss applies the output layer itself, at response positions only (head.py)."""
    from megatron.core.models.gpt import GPTModel

    class HiddenStatesGPTModel(GPTModel):
        def _postprocess(self, hidden_states: torch.Tensor, **kwargs: Any) -> torch.Tensor:
            if kwargs.get("mtp_in_postprocess") or kwargs.get("labels") is not None:
                raise NotImplementedError("multi-token prediction / labels are not used by the megatron backend")
            return hidden_states

    return HiddenStatesGPTModel


def build_gpt_model(spec: ModelSpec, config: Any, vp_stage: int | None = None) -> Any:
    """One model chunk of this rank (pre/post-process from its pipeline position)."""
    from megatron.core import parallel_state
    return hidden_states_gpt_model_class()(
        config=config, transformer_layer_spec=layer_spec(spec, config), vocab_size=spec.padded_vocab_size,
        max_sequence_length=spec.max_position_embeddings,
        pre_process=parallel_state.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage),
        post_process=parallel_state.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage),
        parallel_output=True, share_embeddings_and_output_weights=spec.tie_embeddings,
        position_embedding_type="rope", rotary_percent=1.0, rotary_base=int(spec.rope_theta), vp_stage=vp_stage)
