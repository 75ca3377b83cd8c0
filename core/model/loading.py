"""The one path through which every component loads a policy: any HF checkpoint folder."""

from __future__ import annotations

from pathlib import Path

import torch

from milepost.core.config import ModelConfig


def resolve_model_path(model_cfg: ModelConfig, seed: int) -> str:
    if model_cfg.path == "builtin:tiny-arith":
        from milepost.core.model.tiny import build_tiny_model
        return build_tiny_model(model_cfg.tiny, seed)
    if model_cfg.path.startswith("builtin:"):
        raise ValueError(f"model.path `{model_cfg.path}`: the only builtin model is builtin:tiny-arith")
    if not (Path(model_cfg.path) / "config.json").is_file():
        raise ValueError(f"model.path `{model_cfg.path}` is not an HF checkpoint folder (no config.json); "
                         "pass a folder saved with save_pretrained")
    return model_cfg.path


def load_tokenizer(path: str):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(path)


def load_causal_lm(path: str, dtype: torch.dtype = torch.float32):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
