"""LoRA on the megatron backend: PEFT's adapter on megatron's fused, TP-sharded linears.

The adapter is held in HF's shapes (per layer and HF module: A [r, in], B [out, r]) and is
replicated on every TP rank: it is small, and PEFT's names and the torch backend's
initialisation (core/train/lora.py: per layer, from (seed, HF module name)) then carry over
exactly, so both backends start from the same adapter and export the same PEFT folder.

Forward hooks on megatron's linears add the update to their output:
- column-parallel (linear_qkv = q,k,v; linear_fc1 = gate,up): every rank computes the HF-layout
  updates `B(A(x)) * alpha / r` of all parts and keeps its own rows, laid out as the converter
  lays out weights (`to_megatron` on the transposed activations: fused per query group, or
  [gate_r; up_r]). Each rank's loss reads only its rows, so A's and B's gradients are summed
  over TP (`copy_to_tensor_model_parallel_region` on the parameters and on the input:
  identity forward, all-reduce backward).
- row-parallel (linear_proj = o_proj, linear_fc2 = down_proj): the input is this rank's
  slice of features, so `x_r @ A[:, slice_r]^T` is all-reduced over TP
  (`reduce_from_tensor_model_parallel_region`), then B applies on every rank alike. A's
  gradient is summed over TP (each rank fills its slice); B's is the same on every rank.
Megatron's DDP and optimizer see only the adapter (the base is frozen); its grad-norm counts
a TP-replicated parameter once.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from milepost.core.config import LoraConfig
from milepost.core.train.lora import PEFT_PREFIX, layer_generator
from milepost.core.train.megatron.converter import Mapping, to_megatron
from milepost.core.train.megatron.model import ModelSpec

# HF module -> (megatron linear, how it is split over TP, the HF parts fused in that linear)
TARGETS = {
    "q_proj": ("self_attention.linear_qkv", "qkv", ("q_proj", "k_proj", "v_proj")),
    "k_proj": ("self_attention.linear_qkv", "qkv", ("q_proj", "k_proj", "v_proj")),
    "v_proj": ("self_attention.linear_qkv", "qkv", ("q_proj", "k_proj", "v_proj")),
    "o_proj": ("self_attention.linear_proj", "row", ("o_proj",)),
    "gate_proj": ("mlp.linear_fc1", "fc1", ("gate_proj", "up_proj")),
    "up_proj": ("mlp.linear_fc1", "fc1", ("gate_proj", "up_proj")),
    "down_proj": ("mlp.linear_fc2", "row", ("down_proj",)),
}
HF_PARENT = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn",
             "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}


def check_supported(cfg: LoraConfig, pipeline_parallel: int) -> None:
    """ValueError naming the field and the fix for what this backend cannot adapt yet."""
    unknown = [t for t in cfg.target_modules if t not in TARGETS]
    if unknown:
        raise ValueError(f"train.lora.target_modules {unknown}: the megatron backend adapts {sorted(TARGETS)}; "
                         "drop the others or use train.backend=torch")
    if cfg.dropout > 0:
        raise ValueError("train.lora.dropout > 0 is not supported by the megatron backend yet (TP ranks would need "
                         "one dropout mask); set it to 0 or use train.backend=torch")
    if pipeline_parallel > 1:
        raise ValueError("train.lora with train.megatron.pipeline_parallel > 1 is not supported yet (the adapter "
                         "export reads every layer on rank 0); set pipeline_parallel 1")


def _shapes(spec: ModelSpec) -> dict[str, tuple[int, int]]:
    """(in, out) of each HF module."""
    q, kv, h, f = spec.num_heads * spec.head_dim, spec.num_query_groups * spec.head_dim, spec.hidden_size, \
        spec.ffn_hidden_size
    return {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h), "gate_proj": (h, f),
            "up_proj": (h, f), "down_proj": (f, h)}


def hf_module(layer: int, target: str) -> str:
    return f"model.layers.{layer}.{HF_PARENT[target]}.{target}"


class LayerAdapter(nn.Module):
    """The adapter of one transformer layer: `A_<target>`, `B_<target>` in HF shapes."""

    def __init__(self, layer: int, cfg: LoraConfig, spec: ModelSpec, seed: int, dtype: torch.dtype,
                 device: torch.device) -> None:
        super().__init__()
        self.layer, self.scaling = layer, cfg.alpha / cfg.rank
        for target in cfg.target_modules:
            fan_in, fan_out = _shapes(spec)[target]
            bound = 1.0 / math.sqrt(fan_in)  # PEFT's kaiming_uniform(a=sqrt(5)), as core/train/lora.py
            generator = layer_generator(seed, hf_module(layer, target))
            a = torch.empty(cfg.rank, fan_in, dtype=dtype).uniform_(-bound, bound, generator=generator)
            self.register_parameter(f"A_{target}", nn.Parameter(a.to(device)))
            self.register_parameter(f"B_{target}", nn.Parameter(torch.zeros(fan_out, cfg.rank, dtype=dtype,
                                                                            device=device)))

    def has(self, target: str) -> bool:
        return hasattr(self, f"A_{target}")

    def ab(self, target: str) -> tuple[torch.Tensor, torch.Tensor]:
        return getattr(self, f"A_{target}"), getattr(self, f"B_{target}")


def _column_hook(adapter: LayerAdapter, kind: str, parts: tuple[str, ...], spec: ModelSpec, tp_rank: int,
                 tp_size: int) -> Any:
    from megatron.core.tensor_parallel import copy_to_tensor_model_parallel_region as sum_grads_over_tp
    outs = _shapes(spec)

    def hook(module: nn.Module, inputs: tuple[Any, ...], output: tuple[torch.Tensor, Any]) -> Any:
        x, (out, bias) = inputs[0], output
        # x is the same on every rank; each rank's rows give only part of its gradient (the base
        # layer sums its own share over TP the same way)
        flat = sum_grads_over_tp(x).reshape(-1, x.shape[-1])
        ys = []
        for part in parts:
            if not adapter.has(part):
                ys.append(flat.new_zeros(outs[part][1], flat.shape[0]))
                continue
            a, b = (sum_grads_over_tp(p) for p in adapter.ab(part))
            ys.append((F.linear(F.linear(flat, a), b) * adapter.scaling).t())
        local = to_megatron(Mapping(kind, ()), ys, spec, tp_rank, tp_size).t()
        return out + local.reshape(*x.shape[:-1], -1), bias
    return hook


def _row_hook(adapter: LayerAdapter, target: str, tp_rank: int, tp_size: int) -> Any:
    from megatron.core.tensor_parallel import copy_to_tensor_model_parallel_region as sum_grads_over_tp
    from megatron.core.tensor_parallel import reduce_from_tensor_model_parallel_region as sum_over_tp

    def hook(module: nn.Module, inputs: tuple[Any, ...], output: tuple[torch.Tensor, Any]) -> Any:
        x, (out, bias) = inputs[0], output
        a, b = adapter.ab(target)
        a_local = sum_grads_over_tp(a).chunk(tp_size, dim=1)[tp_rank]
        z = sum_over_tp(F.linear(x, a_local))
        return out + F.linear(z, b) * adapter.scaling, bias
    return hook


def attach(chunks: list[nn.Module], cfg: LoraConfig, spec: ModelSpec, tp_rank: int, tp_size: int, seed: int,
           dtype: torch.dtype, device: torch.device) -> list[LayerAdapter]:
    """Freeze every chunk and hook an adapter onto each transformer layer; the adapters
    (registered as `lora` of their layer, so megatron's DDP and optimizer see them)."""
    adapters = []
    for chunk in chunks:
        chunk.requires_grad_(False)
        decoder: Any = chunk.decoder  # megatron's TransformerBlock
        for layer in decoder.layers:
            index = layer.layer_number - 1  # global (megatron numbers layers from 1)
            if spec.is_moe_layer(index) and any(TARGETS[t][0].startswith("mlp.") for t in cfg.target_modules):
                raise ValueError("train.lora on the MLP of an MoE layer is not supported by the megatron backend "
                                 "yet; target attention only (q_proj, k_proj, v_proj, o_proj)")
            adapter = LayerAdapter(index, cfg, spec, seed, dtype, device)
            layer.lora = adapter
            for linear_name in sorted({TARGETS[t][0] for t in cfg.target_modules}):
                _, kind, parts = next(v for t, v in TARGETS.items() if v[0] == linear_name)
                linear = layer.get_submodule(linear_name)
                hook = (_row_hook(adapter, parts[0], tp_rank, tp_size) if kind == "row"
                        else _column_hook(adapter, kind, parts, spec, tp_rank, tp_size))
                linear.register_forward_hook(hook)
            adapters.append(adapter)
    return adapters


def adapter_state(adapters: list[LayerAdapter], cfg: LoraConfig) -> dict[str, torch.Tensor]:
    """PEFT's names (those core/train/lora.py writes) -> tensors."""
    out = {}
    for adapter in adapters:
        for target in cfg.target_modules:
            a, b = adapter.ab(target)
            name = f"{PEFT_PREFIX}{hf_module(adapter.layer, target)}"
            out[f"{name}.lora_A.weight"], out[f"{name}.lora_B.weight"] = a.detach(), b.detach()
    return out


def load_adapter_state(adapters: list[LayerAdapter], cfg: LoraConfig, state: dict[str, torch.Tensor]) -> None:
    own = adapter_state(adapters, cfg)
    if set(own) != set(state):
        raise ValueError(f"the adapter does not fit the model's LoRA layers: missing "
                         f"{sorted(set(own) - set(state))[:4]}, unexpected {sorted(set(state) - set(own))[:4]}")
    with torch.no_grad():
        for name, tensor in own.items():
            tensor.copy_(state[name])
