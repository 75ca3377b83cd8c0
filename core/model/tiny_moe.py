"""The project's own tiny MoE model: tiny-arith's tokenizer and warm-start on a Qwen3-MoE.

`builtin:tiny-arith-moe` is what MoE routing replay is developed and verified on without a
model hub: transformers' Qwen3-MoE architecture (the one SGLang and Megatron serve for
Qwen3-30B-A3B), `model.tiny_moe.num_experts` routed experts per layer, top-k
`num_experts_per_tok`, attention sized by `model.tiny`. It is warm-started exactly like
tiny-arith (same data, same imperfect answer form, core/model/tiny.py) plus the router's
load-balancing loss, so every expert is in use and routing is a real choice.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from milepost.core.config import TinyModelConfig, TinyMoeConfig
from milepost.core.data.arith import cache_root
from milepost.core.model import tiny

# Bump when the build procedure changes, so caches made by an older procedure are not reused.
BUILD_VERSION = 1


def moe_hf_config(cfg: TinyModelConfig, moe: TinyMoeConfig, vocab_size: int, pad_id: int, eos_id: int) -> Any:
    """The Qwen3MoeConfig of the tiny MoE: every layer sparse, head_dim from the hidden size."""
    from transformers import Qwen3MoeConfig
    # head_dim and torch_dtype: keys transformers takes through **kwargs (not fields of every version)
    return Qwen3MoeConfig(  # type: ignore[call-arg]
        vocab_size=vocab_size, hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_kv_heads, head_dim=cfg.hidden_size // cfg.num_heads,
        num_experts=moe.num_experts, num_experts_per_tok=moe.num_experts_per_tok,
        moe_intermediate_size=moe.moe_intermediate_size, norm_topk_prob=True, decoder_sparse_step=1,
        mlp_only_layers=[], router_aux_loss_coef=moe.router_aux_loss_coef, output_router_logits=False,
        max_position_embeddings=64, tie_word_embeddings=True, pad_token_id=pad_id, eos_token_id=eos_id,
        bos_token_id=eos_id, torch_dtype="float32")


def cached_model_dir(cfg: TinyModelConfig, moe: TinyMoeConfig, seed: int) -> Path:
    key = json.dumps({"cfg": cfg.model_dump(), "moe": moe.model_dump(), "seed": seed,
                      "v": (tiny.BUILD_VERSION, BUILD_VERSION)}, sort_keys=True)
    return cache_root() / "models" / f"tiny-arith-moe-{hashlib.sha256(key.encode()).hexdigest()[:16]}"


def build_tiny_moe_model(cfg: TinyModelConfig, moe: TinyMoeConfig, seed: int) -> str:
    """The cached model folder for (cfg, moe, seed), built on first use."""
    from transformers import Qwen3MoeForCausalLM

    def make_model(c: TinyModelConfig, tokenizer: Any) -> Any:
        return Qwen3MoeForCausalLM(moe_hf_config(c, moe, len(tokenizer), tokenizer.pad_token_id,
                                                 tokenizer.eos_token_id))

    return tiny.build_cached(cached_model_dir(cfg, moe, seed), lambda tmp: tiny._train_and_save(
        cfg, seed, tmp, make_model=make_model, aux_loss_coef=moe.router_aux_loss_coef))
