"""LoRA on the trainer: PEFT's LoRA layers, written out, and PEFT's on-disk format.

`inject(model, cfg, seed)` wraps every `nn.Linear` whose name matches `cfg.target_modules`
(PEFT's rule: the whole name, or its last dotted parts) in a `LoraLinear`:
`y = base(x) + lora_B(lora_A(dropout(x))) * alpha / r`, A initialised as PEFT does
(kaiming-uniform, a = sqrt(5)) and B zero, so the adapted model starts equal to the base
one. The base weights are frozen; only A and B train.

Why our own layers and not peft's: the Megatron backend needs the same adapter on its
TP-sharded layers, and the engine applies it without peft; one small definition keeps the
three in step. peft reads what `save_adapter` writes (tests/unit/test_lora.py loads it with
peft's own `PeftModel.from_pretrained`).

Initialisation is per layer, from a generator seeded by (seed, layer name): the adapter a
trainer starts from does not depend on the order layers are visited, rank count or backend.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from milepost.core.config import LoraConfig

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model."  # PeftModel wraps the HF model twice: base_model (LoraModel), .model


def matches(name: str, targets: Iterable[str]) -> bool:
    """PEFT's target_modules rule for a list: the module's full name, or a suffix after a dot."""
    return any(name == t or name.endswith("." + t) for t in targets)


class LoraLinear(nn.Module):
    """A frozen `base_layer` plus a trainable rank-r update, named as PEFT names them."""

    def __init__(self, base: nn.Linear, rank: int, alpha: float, dropout: float, generator: torch.Generator) -> None:
        super().__init__()
        self.base_layer = base
        base.requires_grad_(False)
        self.lora_A = nn.Linear(base.in_features, rank, bias=False, dtype=base.weight.dtype)
        self.lora_B = nn.Linear(rank, base.out_features, bias=False, dtype=base.weight.dtype)
        self.lora_dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
        self.scaling = alpha / rank
        with torch.no_grad():  # nn.init.kaiming_uniform_(a=sqrt(5)) as PEFT, from our generator
            bound = 1.0 / math.sqrt(base.in_features)  # gain(leaky_relu, sqrt 5) * sqrt(3 / fan_in)
            self.lora_A.weight.uniform_(-bound, bound, generator=generator)
            self.lora_B.weight.zero_()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base_layer(x) + self.lora_B(self.lora_A(self.lora_dropout(x))) * self.scaling


def layer_generator(seed: int, name: str) -> torch.Generator:
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") & (2**63 - 1))


def inject(model: nn.Module, cfg: LoraConfig, seed: int) -> list[str]:
    """Wrap the matching Linear layers in place and freeze everything else; returns their names.
    Raises ValueError naming train.lora.target_modules when nothing matches."""
    found = [(n, m) for n, m in model.named_modules() if isinstance(m, nn.Linear) and matches(n, cfg.target_modules)]
    if not found:
        linears = sorted({n.rsplit(".", 1)[-1] for n, m in model.named_modules() if isinstance(m, nn.Linear)})
        raise ValueError(f"train.lora.target_modules {cfg.target_modules} match no Linear layer of the model; "
                         f"its Linear layers are named {linears}: pick from those")
    model.requires_grad_(False)
    for name, linear in found:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, LoraLinear(linear, cfg.rank, cfg.alpha, cfg.dropout, layer_generator(seed, name)))
    return [n for n, _ in found]


def adapter_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """The adapter's tensors under PEFT's saved names (`base_model.model.<layer>.lora_A.weight`)."""
    out: dict[str, torch.Tensor] = {}
    for name, module in model.named_modules():
        if isinstance(module, LoraLinear):
            out[f"{PEFT_PREFIX}{name}.lora_A.weight"] = module.lora_A.weight.detach()
            out[f"{PEFT_PREFIX}{name}.lora_B.weight"] = module.lora_B.weight.detach()
    return out


def load_adapter_state(model: nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Copy PEFT-named tensors into the model's LoRA layers; every layer must be covered exactly."""
    own = adapter_state(model)
    missing, unexpected = sorted(set(own) - set(state)), sorted(set(state) - set(own))
    if missing or unexpected:
        raise ValueError(f"the adapter does not fit the model's LoRA layers: missing {missing[:4]}, "
                         f"unexpected {unexpected[:4]} (was it trained with other train.lora.target_modules?)")
    with torch.no_grad():
        for name, tensor in own.items():
            tensor.copy_(state[name])


def peft_config(cfg: LoraConfig, base_model: str) -> dict[str, object]:
    """adapter_config.json as peft 0.x writes it for a causal LM (the keys its readers need)."""
    return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_model,
            "r": cfg.rank, "lora_alpha": cfg.alpha, "lora_dropout": cfg.dropout,
            "target_modules": list(cfg.target_modules), "bias": "none", "fan_in_fan_out": False,
            "inference_mode": True, "init_lora_weights": True, "use_rslora": False, "use_dora": False,
            "modules_to_save": None, "layers_to_transform": None, "layers_pattern": None,
            "rank_pattern": {}, "alpha_pattern": {}, "revision": None}


def save_adapter(path: str | Path, state: dict[str, torch.Tensor], cfg: LoraConfig, base_model: str) -> int:
    """Write a PEFT adapter folder; returns the bytes of its tensors file."""
    folder = Path(path)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / ADAPTER_CONFIG).write_text(json.dumps(peft_config(cfg, base_model), indent=2))
    tensors = {k: v.detach().contiguous().cpu() for k, v in state.items()}
    save_file(tensors, str(folder / ADAPTER_WEIGHTS), metadata={"format": "pt"})
    return (folder / ADAPTER_WEIGHTS).stat().st_size


def is_adapter_folder(path: str | Path) -> bool:
    return (Path(path) / ADAPTER_CONFIG).is_file()


def read_adapter(path: str | Path) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """(adapter_config.json, its JSON as read; tensors) of a PEFT adapter folder."""
    folder = Path(path)
    if not is_adapter_folder(folder):
        raise FileNotFoundError(f"{folder} is not a PEFT adapter folder (no {ADAPTER_CONFIG})")
    config = json.loads((folder / ADAPTER_CONFIG).read_text())
    return config, load_file(str(folder / ADAPTER_WEIGHTS))
