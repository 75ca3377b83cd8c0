"""A model's architecture numbers, read from its Hugging Face `config.json`, and what they cost.

The planner needs parameter counts per parallel rank and KV-cache bytes per token, nothing
else, so this reads only the keys that set those: it never imports transformers or torch.
Sharding follows what Megatron-core (trainer) and SGLang (engines) do:
- attention heads, dense MLP, shared experts, embedding and output layer split over TP;
- K/V heads split over TP when TP divides them, else each rank holds one replicated KV head;
- MLA down-projections (and their norms) are replicated on every TP rank, up-projections split;
- routed experts split over EP (whole experts), each expert's hidden size over expert-TP;
- norms and the MoE router are replicated.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3", "qwen3_moe", "deepseek_v3")


@dataclass(frozen=True)
class Architecture:
    """Shapes of a decoder-only transformer (dense or MoE; GQA or MLA attention)."""

    name: str
    model_type: str
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int  # dense MLP (SwiGLU: gate, up, down)
    vocab_size: int
    tied_embeddings: bool
    qkv_bias: bool = False
    qk_norm: bool = False
    # MLA (DeepSeek-V3); attention is GQA when kv_lora_rank is 0.
    q_lora_rank: int = 0
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    # MoE; dense when num_experts is 0.
    num_experts: int = 0
    experts_per_token: int = 0
    expert_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0  # all shared experts together
    moe_layers: tuple[int, ...] = ()  # indices of the layers whose MLP is MoE

    @property
    def is_mla(self) -> bool:
        return self.kv_lora_rank > 0

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    # --- parameters -------------------------------------------------------------------------
    def attention_params(self, tp: int = 1) -> int:
        """Attention parameters of one layer on one of `tp` tensor-parallel ranks."""
        h, nh = self.hidden_size, self.num_heads
        if self.is_mla:
            qk = self.qk_nope_head_dim + self.qk_rope_head_dim
            replicated = h * (self.kv_lora_rank + self.qk_rope_head_dim) + self.kv_lora_rank
            if self.q_lora_rank:
                replicated += h * self.q_lora_rank + self.q_lora_rank
                q_up = self.q_lora_rank * nh * qk
            else:
                q_up = h * nh * qk
            split = q_up + self.kv_lora_rank * nh * (self.qk_nope_head_dim + self.v_head_dim) \
                + nh * self.v_head_dim * h
            return replicated + split // tp
        hd, bias = self.head_dim, int(self.qkv_bias)
        q_and_o = (h * nh * hd + bias * nh * hd + nh * hd * h) // tp
        kv_heads = self.num_kv_heads // tp if self.num_kv_heads >= tp else 1
        kv = 2 * kv_heads * hd * (h + bias)
        return q_and_o + kv + (2 * hd if self.qk_norm else 0)

    def dense_mlp_params(self, tp: int = 1) -> int:
        return 3 * self.hidden_size * self.intermediate_size // tp

    def expert_params(self) -> int:
        """One routed expert (SwiGLU)."""
        return 3 * self.hidden_size * self.expert_intermediate_size

    def layer_params(self, layer: int, tp: int = 1, ep: int = 1, etp: int = 1) -> tuple[int, int]:
        """(non-expert, routed-expert) parameters of `layer` on one rank. Expert parameters
        are kept apart: the distributed optimizer shards them over a different group."""
        h = self.hidden_size
        dense = self.attention_params(tp) + 2 * h  # two RMSNorms
        if layer not in self.moe_layers:
            return dense + self.dense_mlp_params(tp), 0
        router = h * self.num_experts  # DeepSeek's e_score_correction_bias is a buffer, not trained
        shared = 3 * h * self.shared_expert_intermediate_size // tp
        experts = (self.num_experts // ep) * self.expert_params() // etp
        return dense + router + shared, experts

    def embedding_params(self, tp: int = 1) -> int:
        return self.vocab_size * self.hidden_size // tp

    def total_params(self) -> int:
        """All parameters (the main model: DeepSeek-V3's multi-token-prediction head excluded)."""
        layers = sum(sum(self.layer_params(i)) for i in range(self.num_layers))
        heads = self.embedding_params() * (1 if self.tied_embeddings else 2)
        return layers + heads + self.hidden_size  # + final norm

    def active_params(self) -> int:
        """Parameters one token passes through (MoE: only its routed experts)."""
        if not self.is_moe:
            return self.total_params()
        unused = len(self.moe_layers) * (self.num_experts - self.experts_per_token) * self.expert_params()
        return self.total_params() - unused

    # --- KV cache ---------------------------------------------------------------------------
    def kv_elements_per_token(self, tp: int = 1) -> int:
        """KV-cache elements one token needs on one of `tp` engine ranks, all layers.
        MLA caches the compressed latent plus the RoPE key, the same on every TP rank."""
        if self.is_mla:
            return self.num_layers * (self.kv_lora_rank + self.qk_rope_head_dim)
        kv_heads = self.num_kv_heads // tp if self.num_kv_heads >= tp else 1
        return self.num_layers * 2 * kv_heads * self.head_dim


def _need(cfg: dict[str, Any], key: str, source: str) -> Any:
    if key not in cfg:
        raise ValueError(f"{source}: config.json has no `{key}`; it is needed to plan a "
                         f"`{cfg.get('model_type')}` model. Check the file or set model.catalog")
    return cfg[key]


def from_hf_config(cfg: dict[str, Any], name: str, source: str = "config.json") -> Architecture:
    """An `Architecture` from the keys of an HF `config.json` (a dict)."""
    model_type = cfg.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(f"{source}: model_type {model_type!r} cannot be planned; supported: "
                         f"{', '.join(SUPPORTED_MODEL_TYPES)}")

    def g(key: str) -> Any:
        return _need(cfg, key, source)

    h, nh, layers = g("hidden_size"), g("num_attention_heads"), g("num_hidden_layers")
    common: dict[str, Any] = dict(
        name=name, model_type=model_type, hidden_size=h, num_layers=layers, num_heads=nh,
        num_kv_heads=cfg.get("num_key_value_heads") or nh, head_dim=cfg.get("head_dim") or h // nh,
        intermediate_size=g("intermediate_size"), vocab_size=g("vocab_size"),
        tied_embeddings=bool(cfg.get("tie_word_embeddings", False)))
    if model_type == "qwen2":
        common["qkv_bias"] = True
    if model_type in ("qwen3", "qwen3_moe"):
        common["qk_norm"] = True
        common["qkv_bias"] = bool(cfg.get("attention_bias", False))
    if model_type == "llama":
        common["qkv_bias"] = bool(cfg.get("attention_bias", False))
    if model_type == "qwen3_moe":
        step, dense_only = cfg.get("decoder_sparse_step", 1), set(cfg.get("mlp_only_layers") or [])
        moe = tuple(i for i in range(layers) if i not in dense_only and (i + 1) % step == 0)
        common.update(num_experts=g("num_experts"), experts_per_token=g("num_experts_per_tok"),
                      expert_intermediate_size=g("moe_intermediate_size"), moe_layers=moe)
    if model_type == "deepseek_v3":
        first_dense, freq = g("first_k_dense_replace"), cfg.get("moe_layer_freq", 1)
        moe = tuple(i for i in range(layers) if i >= first_dense and i % freq == 0)
        common.update(
            num_kv_heads=nh, q_lora_rank=cfg.get("q_lora_rank") or 0, kv_lora_rank=g("kv_lora_rank"),
            qk_nope_head_dim=g("qk_nope_head_dim"), qk_rope_head_dim=g("qk_rope_head_dim"),
            v_head_dim=g("v_head_dim"), num_experts=g("n_routed_experts"),
            experts_per_token=g("num_experts_per_tok"), expert_intermediate_size=g("moe_intermediate_size"),
            shared_expert_intermediate_size=cfg.get("n_shared_experts", 0) * g("moe_intermediate_size"),
            moe_layers=moe)
    return Architecture(**common)
