"""HF configs of the models milepost ships recipes for, and how the planner finds a model's.

The numbers are those of the public `config.json` files (only the keys the planner reads), so
a recipe can be planned on a machine that cannot read the cluster's checkpoint folder. When
`model.path` has a readable `config.json`, that file wins: it is what will actually be loaded.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from milepost.core.config import ModelConfig, TinyModelConfig
from milepost.core.plan.arch import Architecture, from_hf_config

_QWEN3_COMMON: dict[str, Any] = {"vocab_size": 151936, "head_dim": 128, "max_position_embeddings": 40960}

CATALOG: dict[str, dict[str, Any]] = {
    "Qwen3-0.6B": {**_QWEN3_COMMON, "model_type": "qwen3", "hidden_size": 1024, "intermediate_size": 3072,
                   "num_hidden_layers": 28, "num_attention_heads": 16, "num_key_value_heads": 8,
                   "tie_word_embeddings": True},
    "Qwen3-8B": {**_QWEN3_COMMON, "model_type": "qwen3", "hidden_size": 4096, "intermediate_size": 12288,
                 "num_hidden_layers": 36, "num_attention_heads": 32, "num_key_value_heads": 8,
                 "tie_word_embeddings": False},
    "Qwen3-30B-A3B": {**_QWEN3_COMMON, "model_type": "qwen3_moe", "hidden_size": 2048, "intermediate_size": 6144,
                      "num_hidden_layers": 48, "num_attention_heads": 32, "num_key_value_heads": 4,
                      "moe_intermediate_size": 768, "num_experts": 128, "num_experts_per_tok": 8,
                      "decoder_sparse_step": 1, "mlp_only_layers": [], "tie_word_embeddings": False},
    "DeepSeek-V3": {"model_type": "deepseek_v3", "vocab_size": 129280, "hidden_size": 7168,
                    "intermediate_size": 18432, "num_hidden_layers": 61, "num_attention_heads": 128,
                    "num_key_value_heads": 128, "q_lora_rank": 1536, "kv_lora_rank": 512,
                    "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
                    "n_routed_experts": 256, "n_shared_experts": 1, "num_experts_per_tok": 8,
                    "moe_intermediate_size": 2048, "first_k_dense_replace": 3, "moe_layer_freq": 1,
                    "num_nextn_predict_layers": 1, "max_position_embeddings": 163840,
                    "tie_word_embeddings": False},
}

# The tiny model's tokenizer: 2 specials + 13 characters (core/model/tiny.py; a test keeps
# them equal). Not imported from there: that module imports torch, and planning must not.
TINY_VOCAB_SIZE = 15


def tiny_hf_config(model_cfg: ModelConfig, sizes: TinyModelConfig | None = None) -> dict[str, Any]:
    """The HF config `builtin:tiny-arith` is built with (a Qwen2, tied embeddings); `sizes`:
    another builtin's section of the same shape (model.gpu_arith)."""
    t = sizes or model_cfg.tiny
    return {"model_type": "qwen2", "vocab_size": TINY_VOCAB_SIZE, "hidden_size": t.hidden_size,
            "intermediate_size": t.intermediate_size, "num_hidden_layers": t.num_layers,
            "num_attention_heads": t.num_heads, "num_key_value_heads": t.num_kv_heads,
            "tie_word_embeddings": True}


def tiny_moe_hf_config(model_cfg: ModelConfig) -> dict[str, Any]:
    """The HF config `builtin:tiny-arith-moe` is built with (core/model/tiny_moe.py: a Qwen3-MoE)."""
    t, m = model_cfg.tiny, model_cfg.tiny_moe
    return {**tiny_hf_config(model_cfg), "model_type": "qwen3_moe", "head_dim": t.hidden_size // t.num_heads,
            "num_experts": m.num_experts, "num_experts_per_tok": m.num_experts_per_tok,
            "moe_intermediate_size": m.moe_intermediate_size, "decoder_sparse_step": 1, "mlp_only_layers": []}


def _readable_config(path: str) -> Path | None:
    local = path.removeprefix("file://")
    if "://" in local:
        return None  # remote stores are read by the run itself, not by the planner
    candidate = Path(local) / "config.json"
    return candidate if candidate.is_file() else None


def resolve_architecture(model_cfg: ModelConfig) -> tuple[Architecture, str]:
    """The architecture of the recipe's model and where it was read from."""
    if model_cfg.path == "builtin:tiny-arith":
        return from_hf_config(tiny_hf_config(model_cfg), "tiny-arith"), "builtin tiny model (model.tiny)"
    if model_cfg.path == "builtin:tiny-arith-moe":
        return (from_hf_config(tiny_moe_hf_config(model_cfg), "tiny-arith-moe"),
                "builtin tiny MoE model (model.tiny, model.tiny_moe)")
    if model_cfg.path == "builtin:gpu-arith":
        return (from_hf_config(tiny_hf_config(model_cfg, model_cfg.gpu_arith), "gpu-arith"),
                "builtin gpu-arith model (model.gpu_arith)")
    config_file = _readable_config(model_cfg.path)
    if config_file is not None:
        try:
            cfg = json.loads(config_file.read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise ValueError(f"{config_file}: cannot read it as JSON ({e}); fix the file or set model.catalog "
                             "and point model.path elsewhere") from None
        return from_hf_config(cfg, Path(model_cfg.path).name or model_cfg.path, str(config_file)), str(config_file)
    if model_cfg.catalog is None:
        raise ValueError(f"model.path `{model_cfg.path}` has no config.json readable on this machine; set "
                         f"model.catalog to one of {', '.join(CATALOG)} (the architecture to plan with)")
    if model_cfg.catalog not in CATALOG:
        raise ValueError(f"model.catalog `{model_cfg.catalog}` is not a shipped config; known: {', '.join(CATALOG)}")
    return (from_hf_config(CATALOG[model_cfg.catalog], model_cfg.catalog, f"catalog {model_cfg.catalog}"),
            f"catalog `{model_cfg.catalog}` (model.path not readable here)")


def catalog_mismatch(model_cfg: ModelConfig, arch: Architecture) -> str | None:
    """When both a readable config.json and model.catalog are given and they disagree, say how:
    the recipe probably names the wrong catalog entry (the plan uses config.json)."""
    if model_cfg.catalog not in CATALOG or arch.name == model_cfg.catalog:
        return None
    ref = from_hf_config(CATALOG[model_cfg.catalog], model_cfg.catalog)
    keys = ("hidden_size", "num_layers", "num_heads", "num_kv_heads", "intermediate_size", "num_experts",
            "vocab_size")
    diff = [f"{k} {getattr(arch, k)} vs {getattr(ref, k)}" for k in keys if getattr(arch, k) != getattr(ref, k)]
    if not diff:
        return None
    return (f"model.catalog `{model_cfg.catalog}` differs from model.path's config.json ({', '.join(diff)}); "
            "the plan uses config.json")
