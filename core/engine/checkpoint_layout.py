"""Checkpoint tensors named the way the live model names them, for /update_weights_from_disk.

transformers 5 saves some architectures in a layout other than the module's own: a Qwen3-MoE
layer's experts live in the module as two fused tensors (`experts.gate_up_proj` [E, 2I, H],
`experts.down_proj` [E, H, I]) but are saved one Linear per expert (`experts.<e>.gate_proj.weight`
…, the hub layout SGLang and vLLM read), and fused again by `from_pretrained`'s conversion.
The engine's disk update compares names with the live model, so such a folder is loaded
through that same conversion: one model construction per push, which only the built-in
engine's small models pay (a large MoE is served by SGLang).
"""

from __future__ import annotations

import torch


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
