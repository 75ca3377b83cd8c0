"""precision.train fp8 in the megatron backend: the GEMMs of the transformer layers' linears
(attention qkv / proj, MLP fc1 / fc2, MoE experts' fc1 / fc2: megatron-core's local
ColumnParallelLinear / RowParallelLinear) go through `core/quant/fp8_linear.py`.

What stays bf16: the embedding, the output layer (its logits feed the logprobs and the loss
directly; it is also applied by head.py at response positions only), MoE routers (not
Column/RowParallelLinear), norms, attention, and any linear whose feature dims `_scaled_mm`
refuses (listed once, at build, by the worker). Parameters, their names, DDP buckets, the
optimizer (fp32 master weights and Adam state), checkpoints and exported weights are those of
bf16 training: only the layer's class changes (a subclass with `_forward_impl` replaced), as
int4 QAT does for the torch backend.

Tensor parallelism: ColumnParallelLinear all-reduces its input gradient inside its linear
function (`allreduce_dgrad`), so `Fp8LinearFunction` does it too, over the layer's TP group;
RowParallelLinear's all-reduce of the output stays in megatron's forward. Sequence parallel
(an all-gather inside the linear function) is refused here (the backend refuses it anyway
without Transformer Engine).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any

import torch

from milepost.core.quant.fp8_cast import Fp8Recipe
from milepost.core.quant.fp8_delayed import AmaxHistory
from milepost.core.quant.fp8_linear import Fp8LinearFunction, fp8_shape_problem

KEEP_BF16 = ("output_layer",)  # module names (last part) that stay in bf16 whatever their shape

# train.megatron.fp8_recipe -> the recipe (core/config.py Fp8RecipeName lists the same names)
RECIPES: dict[str, Fp8Recipe] = {
    "rowwise": Fp8Recipe(),
    "rowwise-gw-bf16": Fp8Recipe(wgrad_fp8=False),
    "tensorwise": Fp8Recipe("tensorwise"),
    "tensorwise-fast": Fp8Recipe("tensorwise", fast_accum=True),
    "tensorwise-fast-delayed": Fp8Recipe("tensorwise", fast_accum=True, amax_history=16),
    "tensorwise-fast-e4m3": Fp8Recipe("tensorwise", fast_accum=True, e4m3_gradients=True),
}


@dataclass
class Fp8Layers:
    """What `attach_fp8` did: layer names in fp8, and the bf16 ones with the reason."""

    fp8: list[str] = field(default_factory=list)
    bf16: dict[str, str] = field(default_factory=dict)

    def describe(self) -> str:
        """One line for the log: the count in fp8 and each bf16 fallback reason, counted once."""
        reasons: dict[str, int] = {}
        for reason in self.bf16.values():
            reasons[reason] = reasons.get(reason, 0) + 1
        fallbacks = "; ".join(f"{n} layer(s): {r}" for r, n in sorted(reasons.items()))
        return (f"{len(self.fp8)} linear layer(s) through torch._scaled_mm, {len(self.bf16)} in bf16"
                + (f" ({fallbacks})" if fallbacks else ""))


def _fp8_forward_impl(self: Any, input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                      gradient_accumulation_fusion: bool, allreduce_dgrad: bool, sequence_parallel: bool,
                      grad_output_buffer: Any = None, wgrad_deferral_limit: Any = None, tp_group: Any = None,
                      **_: Any) -> torch.Tensor:
    """megatron's `_forward_impl` signature (tensor_parallel/layers.py), the GEMM in fp8."""
    if sequence_parallel or gradient_accumulation_fusion or grad_output_buffer is not None:
        raise ValueError("precision.train fp8 does not support sequence_parallel, gradient accumulation fusion or "
                         "deferred embedding wgrad; turn them off (train.megatron.sequence_parallel false)")
    if allreduce_dgrad and tp_group is None:
        from megatron.core.parallel_state import get_tensor_model_parallel_group
        tp_group = get_tensor_model_parallel_group()
    return Fp8LinearFunction.run(input, weight, bias, self.fp8_recipe, allreduce_dgrad, tp_group, self.fp8_history)


@functools.cache
def fp8_classes() -> dict[type, type]:
    """megatron's ColumnParallelLinear / RowParallelLinear -> the same with its GEMM in fp8."""
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
    return {base: type(f"Fp8{base.__name__}", (base,), {"_forward_impl": _fp8_forward_impl})
            for base in (ColumnParallelLinear, RowParallelLinear)}


def _edge_layer_prefixes(chunk: Any, edge_layers: int) -> list[str]:
    """Module-name prefixes ("decoder.layers.3.") of the chunk's transformer layers among the
    first or last `edge_layers` of the whole model (megatron's global, 1-based `layer_number`,
    so pipeline stages agree on which layers those are)."""
    if edge_layers <= 0:
        return []
    prefixes = []
    for name, module in chunk.named_modules():
        if not (hasattr(module, "mlp") and isinstance(getattr(module, "layer_number", None), int)):
            continue  # not a TransformerLayer
        number, total = module.layer_number, module.config.num_layers
        if number <= edge_layers or number > total - edge_layers:
            prefixes.append(name + ".")
    return prefixes


def attach_fp8(chunks: list[Any], recipe: Fp8Recipe, bf16_edge_layers: int = 0) -> Fp8Layers:
    """Turn the transformer linears of every model chunk into their fp8 class, in place (before
    DDP wraps them). Returns which layers went fp8 and which stay bf16, and why.
    `bf16_edge_layers`: the first and the last that many transformer layers stay bf16
    (train.megatron.fp8_bf16_edge_layers; Transformer Engine's `first_last_layers_bf16`)."""
    classes = fp8_classes()
    done = Fp8Layers()
    for i, chunk in enumerate(chunks):
        edges = _edge_layer_prefixes(chunk, bf16_edge_layers)
        for name, module in chunk.named_modules():
            if type(module) not in classes:
                continue
            label = f"chunk{i}.{name}" if len(chunks) > 1 else name
            problem = ("kept in bf16: the output layer" if name.rsplit(".", 1)[-1] in KEEP_BF16
                       else f"kept in bf16: one of the first / last {bf16_edge_layers} transformer layers"
                       if any(name.startswith(p) for p in edges)
                       else fp8_shape_problem(*module.weight.shape))
            if problem is not None:
                done.bf16[label] = problem
                continue
            module.__class__ = classes[type(module)]
            module.fp8_recipe = recipe
            # delayed scaling: each layer its own amax records (checkpointed apart: amax_histories)
            module.fp8_history = AmaxHistory(recipe.amax_history) if recipe.amax_history else None
            done.fp8.append(label)
    return done


def _fp8_layers(chunks: list[Any]) -> list[tuple[str, Any]]:
    """(name as attach_fp8 labels it, layer) of every layer in fp8."""
    classes = set(fp8_classes().values())
    return [(f"chunk{i}.{name}" if len(chunks) > 1 else name, module)
            for i, chunk in enumerate(chunks) for name, module in chunk.named_modules() if type(module) in classes]


def amax_histories(chunks: list[Any]) -> dict[str, dict[str, torch.Tensor]]:
    """Delayed scaling's amax records of every fp8 layer that has them, by layer name, on the
    CPU: this rank's share of the train state (the worker saves it with each checkpoint)."""
    return {name: layer.fp8_history.state() for name, layer in _fp8_layers(chunks)
            if getattr(layer, "fp8_history", None) is not None and layer.fp8_history.records}


def restore_amax_histories(chunks: list[Any], saved: dict[str, dict[str, torch.Tensor]]) -> str | None:
    """Put `amax_histories`' records back into the same layers; None when done, else why they
    cannot be (then every history starts again, as at a fresh start)."""
    layers = {name: layer for name, layer in _fp8_layers(chunks) if getattr(layer, "fp8_history", None) is not None}
    if set(saved) - set(layers):
        return f"the checkpoint has amax records of {len(set(saved) - set(layers))} layer(s) this model has not in fp8"
    try:
        for name, state in saved.items():
            layers[name].fp8_history.load_state(state, layers[name].weight.device)
    except ValueError as exc:
        for layer in layers.values():
            layer.fp8_history.clear()
        return str(exc)
    return None
