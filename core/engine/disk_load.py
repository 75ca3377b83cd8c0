"""What the built-in engine reads from disk: an HF folder's weights for
/update_weights_from_disk (checked against the live model before anything changes) and the
model's tokenizer at start-up.

Checkpoint tensors are named the way the live model names them. transformers 5 saves some
architectures in a layout other than the module's own: a Qwen3-MoE layer's experts live in
the module as two fused tensors (`experts.gate_up_proj` [E, 2I, H], `experts.down_proj`
[E, H, I]) but are saved one Linear per expert (`experts.<e>.gate_proj.weight` …, the hub
layout SGLang and vLLM read), and fused again by `from_pretrained`'s conversion.
The engine's disk update compares names with the live model, so such a folder is loaded
through that same conversion: one model construction per push, which only the built-in
engine's small models pay (a large MoE is served by SGLang).
"""

from __future__ import annotations

import glob
import os
from typing import Any

import torch
from safetensors.torch import load_file

from milepost.core.engine.quantized import served_state

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "tokenizer.model")


def checkpoint_files(path: str) -> list[str]:
    """The safetensors files of the HF folder `path`, in a fixed order."""
    return sorted(glob.glob(os.path.join(path, "*.safetensors")))


def read_checkpoint(files: list[str], model: torch.nn.Module, path: str) -> dict[str, torch.Tensor] | str:
    """The tensors of `files` (from `path`), named as the live model names them, or why they
    do not fit it (then nothing may change: they are checked before any is swapped in)."""
    state: dict[str, torch.Tensor] = {}
    for f in files:
        state.update(load_file(f))
    state = live_layout(state, model, path)  # a saved MoE's per-expert tensors, fused as live
    state = served_state(model, state)  # --quantization fp8: an unquantised export, quantised as at load
    return check_state(state, model) or state


def check_state(state: dict[str, torch.Tensor], model: torch.nn.Module) -> str | None:
    """Names and shapes must match the live model (a tied lm_head may be absent)."""
    own = model.state_dict()
    tied = bool(getattr(model.config, "tie_word_embeddings", False))
    missing = [k for k in own if k not in state and not (tied and k == "lm_head.weight")]
    unexpected = [k for k in state if k not in own]
    shapes = [k for k in state if k in own and state[k].shape != own[k].shape]
    if missing or unexpected or shapes:
        return f"weights do not fit the model: missing {missing[:5]}, unexpected {unexpected[:5]}, " \
               f"shape mismatch {shapes[:5]}"
    return None


def load_tokenizer(path: str) -> Any:
    """The model's tokenizer, or None for a bare checkpoint (input_ids only). transformers 5
    builds an empty tokenizer from config.json alone, so look for tokenizer files first."""
    from transformers import AutoTokenizer

    if os.path.isdir(path) and not any(os.path.exists(os.path.join(path, f)) for f in TOKENIZER_FILES):
        return None
    try:
        return AutoTokenizer.from_pretrained(path)
    except Exception:  # noqa: BLE001 - no usable tokenizer: the engine serves input_ids only
        return None


def live_layout(state: dict[str, torch.Tensor], model: torch.nn.Module, path: str) -> dict[str, torch.Tensor]:
    """`state` (read raw from `path`'s safetensors) if its names are the live model's; else
    the folder loaded by transformers (its key conversion), a tied lm_head left out."""
    own = model.state_dict()
    if all(name in own for name in state):
        return state
    from transformers import AutoModelForCausalLM

    loaded = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).state_dict()
    tied = bool(getattr(model.config, "tie_word_embeddings", False))
    return {k: v for k, v in loaded.items() if not (tied and k == "lm_head.weight")}
