"""precision.train int4_qat in the megatron backend: the transformer linears (attention qkv /
proj, MLP fc1 / fc2, MoE experts' fc1 / fc2: megatron-core's ColumnParallelLinear /
RowParallelLinear) compute with their weight fake-quantised to group-wise int4
(core/quant/int4.py, straight-through gradients), as the torch backend's Int4QatLinear does.

Why the served policy is the trained one, bit for bit: an engine serving `precision.rollout:
int4` quantises the pushed HF weights with the same function, one group per 128
consecutive input features of one output row. A row's q and scales depend on that row
alone, so the rows megatron fuses (q/k/v of a query group in linear_qkv, gate and up in
linear_fc1) and the rows a column-parallel rank holds quantise as their HF rows do. A
row-parallel rank holds a slice of every row's input features: its groups are the HF groups
only when the slice is whole groups, so with tensor parallelism a row-parallel layer needs
its input size to be a multiple of 128 x tensor_parallel (`int4_shard_problem`; refused at
build, naming the layer).

What stays unquantised: the embedding, the output layer and MoE routers (`quantized_linears`
leaves out the head and routers on the engine's side too), norms, attention.
Parameters are those of the dtype int4_qat computes in (core/quant/modes.py int4_dtype): on
GPUs bf16, with fp32 master weights in megatron's optimizer (bf16 training with fake-quantised
linears: the weight is quantised from the bf16 parameter in fp32 arithmetic and dequantised to
bf16, as an engine at `--dtype bfloat16` serves it; fp32 GEMMs ran at 0.087x bf16's tokens/s on
the H100); on CPUs fp32, as in the torch backend. Nothing else changes: DDP buckets, optimizer,
checkpoints and exported weights are that dtype's training. Only the layer's class changes (a
subclass with `_forward_impl` replaced), as fp8 does (megatron/fp8.py).
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from milepost.core.quant.int4 import GROUP_SIZE, fake_quantize_int4

KEEP_UNQUANTISED = ("output_layer",)  # the head: the engine does not quantise it either


def _int4_forward_impl(self: Any, input: torch.Tensor, weight: torch.Tensor, *args: Any, **kwargs: Any
                       ) -> torch.Tensor:
    """megatron's `_forward_impl`, with the weight it multiplies by fake-quantised."""
    if kwargs.get("gradient_accumulation_fusion"):
        raise ValueError("precision.train int4_qat does not support gradient accumulation fusion (it writes the "
                         "gradient into the parameter's main_grad, past the fake quantisation)")
    base: Any = type(self).__mro__[1]  # megatron's ColumnParallelLinear / RowParallelLinear
    out: torch.Tensor = base._forward_impl(self, input, fake_quantize_int4(weight), *args, **kwargs)
    return out


@functools.cache
def int4_classes() -> dict[type, type]:
    """megatron's ColumnParallelLinear / RowParallelLinear -> the same with int4 fake-quantised weights."""
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
    return {base: type(f"Int4Qat{base.__name__}", (base,), {"_forward_impl": _int4_forward_impl})
            for base in (ColumnParallelLinear, RowParallelLinear)}


def int4_shard_problem(name: str, input_size: int, input_size_per_rank: int, tp_size: int) -> str | None:
    """Why a layer's per-rank weight would not quantise in the HF groups, or None."""
    if input_size_per_rank == input_size or input_size_per_rank % GROUP_SIZE == 0:
        return None
    return (f"precision.train int4_qat: {name} splits its {input_size} input features over tensor_parallel "
            f"{tp_size} ({input_size_per_rank} a rank), which cuts int4 groups of {GROUP_SIZE}; use a "
            f"tensor_parallel that leaves each rank a multiple of {GROUP_SIZE} features, or tensor_parallel 1")


def attach_int4_qat(chunks: list[Any], tp_size: int) -> list[str]:
    """Turn the transformer linears of every model chunk into their int4-QAT class, in place
    (before DDP wraps them). Returns the layers' names; ValueError names a layer whose tensor
    parallel split cuts int4 groups."""
    from megatron.core.tensor_parallel.layers import RowParallelLinear
    classes = int4_classes()
    done: list[str] = []
    for i, chunk in enumerate(chunks):
        for name, module in chunk.named_modules():
            if type(module) not in classes or name.rsplit(".", 1)[-1] in KEEP_UNQUANTISED:
                continue
            label = f"chunk{i}.{name}" if len(chunks) > 1 else name
            if isinstance(module, RowParallelLinear):
                problem = int4_shard_problem(label, module.input_size, module.input_size_per_partition, tp_size)
                if problem is not None:
                    raise ValueError(problem)
            module.__class__ = classes[type(module)]
            done.append(label)
    return done
