"""What `precision.train` does inside a trainer rank (the table of modes: core/quant/modes.py).

- fp32: nothing.
- bf16, torch backend (CPU): the forward runs under `torch.autocast(bfloat16)` over fp32
  parameters. The parameters *are* the master weights: AdamW's state, gradients, checkpoints
  and the weights pushed to engines stay fp32, and a bf16 engine rounds them exactly as
  autocast does for each matmul. Why autocast rather than bf16 parameters with an fp32
  master copy: nothing to keep in step (no second copy, no copy-back after each optimizer
  step, checkpoints unchanged), and on CPU there is no memory to win.
- bf16, megatron backend: on GPU megatron's own mixed precision (bf16 parameters, fp32 master
  weights and Adam state in its optimizer, fp32 gradient reduction); on CPU, where megatron's
  bf16 optimizer refuses CPU tensors, autocast over fp32 parameters as the torch backend.
- int4_qat (torch backend): every Linear that the engine quantises (int4.quantized_linears)
  computes with `fake_quantize_int4(weight)`: the int4-dequantised weight, bit for bit the one
  an engine serving `precision.rollout: int4` builds from the same pushed fp32 weights, with
  straight-through gradients into the fp32 master weights. Parameters and their names are
  unchanged, so DDP, the optimizer, checkpoints and weight sync see the same tensors.
- int4_qat, megatron backend: the transformer linears' weights fake-quantised the same way
  inside megatron's linear (core/train/megatron/int4_qat.py); on GPU with bf16 parameters and
  fp32 masters (bf16's mixed precision), on CPU fp32 parameters (quant/modes.py int4_dtype).
"""

from __future__ import annotations

import contextlib
from contextlib import AbstractContextManager
from typing import TypeVar

import torch
import torch.nn.functional as F

from milepost.core.quant.int4 import fake_quantize_int4, quantized_linears


def autocast(precision: str, device_type: str = "cpu") -> AbstractContextManager[object]:
    """The context a forward runs in: bf16 autocast for `bf16`, nothing otherwise."""
    if precision == "bf16":
        return torch.autocast(device_type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


class Int4QatLinear(torch.nn.Linear):
    """A Linear computing with its weight fake-quantised to group-wise int4 (core/quant/int4.py).
    It holds nothing more than nn.Linear: `attach_int4_qat` turns Linears into it in place."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, fake_quantize_int4(self.weight), self.bias)


def attach_int4_qat(model: torch.nn.Module) -> list[str]:
    """Make every quantised Linear of `model` an Int4QatLinear, keeping the module object, its
    parameters and hooks (its class is swapped: a subclass with only `forward` changed).
    Call before wrapping in DDP. Returns the layer names."""
    layers = quantized_linears(model)
    for layer in layers.values():
        if type(layer) is not torch.nn.Linear:
            raise TypeError(f"int4 QAT expects plain nn.Linear layers, got {type(layer).__name__}")
        layer.__class__ = Int4QatLinear
    return sorted(layers)


ModelT = TypeVar("ModelT", bound=torch.nn.Module)


def prepare_model(model: ModelT, precision: str) -> ModelT:
    """`model` (fp32 parameters) made ready to train in `precision` (torch backend)."""
    if precision == "int4_qat":
        attach_int4_qat(model)
    elif precision not in ("fp32", "bf16"):
        raise ValueError(f"precision.train {precision} is not built for the torch backend (core/quant/modes.py)")
    return model
