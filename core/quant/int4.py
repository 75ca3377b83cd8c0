"""Group-wise symmetric INT4 weight quantisation: pure tensor functions.

One format, used by the trainer (fake-quantised weights in the forward, `precision.train:
int4_qat`) and the built-in engine (int4 weights served, `precision.rollout: int4`), so the
policy trained is the policy served, bit for bit:

- a Linear weight `w: [out, in]` is cut into groups of `group_size(in)` consecutive input
  features of one output row: GROUP_SIZE (128), or the whole row when it is shorter; a
  ragged last group is zero-padded (a zero never raises a group's max);
- `scale[r, g] = max(MIN_SCALE, max |w[r, group g]| / 7)`, float32;
- `q = clamp(round(w / scale), -7, 7)` (round half to even), int4 values held in int8;
- the weight used is `q.float() * scale` (float32), cast to the weight's dtype.

All arithmetic is float32 whatever the weight's dtype. The same input bits always give the
same `q`, `scale` and dequantised bits (elementwise ops and one max per group: no reduction
order to vary). Packing follows compressed-tensors' `weight_packed` (what SGLang loads):
`q + 8` in four bits, eight values per int32, value j of a word in bits 4j..4j+3.

Which layers: every `nn.Linear` but the output head and MoE routers (`quantized_linears`).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable

import torch
from torch import Tensor

GROUP_SIZE = 128
QMAX = 7  # symmetric: [-7, 7]; -8 is never used, so 0 is exact and the range is centred
MIN_SCALE = 1e-5  # an all-zero group still gets a finite scale (its q are all 0)
PACK = 8  # int4 values per int32


def group_size(in_features: int) -> int:
    """Features per group along a row: GROUP_SIZE, or the row when shorter."""
    return min(GROUP_SIZE, in_features)


def num_groups(in_features: int) -> int:
    return math.ceil(in_features / group_size(in_features))


def _grouped(w: Tensor) -> Tensor:
    """w: [out, in] -> float32 [out, groups, group] (zero-padded)."""
    out, cols = w.shape
    g, n = group_size(cols), num_groups(cols)
    x = w.detach().float()
    if n * g != cols:
        x = torch.nn.functional.pad(x, (0, n * g - cols))
    return x.view(out, n, g)


def quantize_int4(w: Tensor) -> tuple[Tensor, Tensor]:
    """w: [out, in] (any float dtype) -> (q: int8 [out, in] in [-7, 7], scale: float32 [out, groups])."""
    if w.dim() != 2:
        raise ValueError(f"int4 quantisation takes a 2-D Linear weight, got shape {list(w.shape)}")
    x = _grouped(w)
    scale = (x.abs().amax(dim=-1, keepdim=True) / QMAX).clamp(min=MIN_SCALE)
    q = torch.round(x / scale).clamp(-QMAX, QMAX)
    return q.view(w.shape[0], -1)[:, :w.shape[1]].to(torch.int8), scale.squeeze(-1)


def dequantize_int4(q: Tensor, scale: Tensor, dtype: torch.dtype = torch.float32) -> Tensor:
    """q: int8 [out, in], scale: float32 [out, groups] -> the weight used: [out, in] in `dtype`."""
    out, cols = q.shape
    g, n = group_size(cols), num_groups(cols)
    x = q.float()
    if n * g != cols:
        x = torch.nn.functional.pad(x, (0, n * g - cols))
    w = x.view(out, n, g) * scale.float().unsqueeze(-1)
    return w.view(out, n * g)[:, :cols].to(dtype)


def dequantize_packed(packed: Tensor, scale: Tensor, in_features: int, dtype: torch.dtype) -> Tensor:
    """packed: int32 [out, words], scale: float32 [out, groups] -> the weight used: [out, in_features]
    in `dtype` (unpack_int4, then dequantize_int4)."""
    return dequantize_int4(unpack_int4(packed, in_features), scale, dtype)


@functools.cache
def compiled_dequantize_packed() -> Callable[[Tensor, Tensor, int, torch.dtype], Tensor]:
    """`dequantize_packed` as one compiled kernel (an int4 engine on a GPU dequantises every
    weight at every forward: eager, the int64 unpacking alone moves 16 bytes a weight). Its
    arithmetic is elementwise (shifts, one float32 product, one cast), so its bits are the
    eager function's; tests/gpu/test_megatron_int4_gpu.py compares them with the trainer's."""
    return torch.compile(dequantize_packed, dynamic=True)


class _FakeQuantInt4(torch.autograd.Function):
    """Forward: the dequantised int4 weight, exactly. Backward: the gradient unchanged
    (straight-through). A custom Function, not `w + (fq - w).detach()`: that sum is rounded
    again and would not equal the served weight bit for bit."""

    @staticmethod
    def forward(ctx, w: Tensor) -> Tensor:
        return dequantize_int4(*quantize_int4(w), dtype=w.dtype)

    @staticmethod
    def backward(ctx, grad: Tensor) -> Tensor:
        return grad


def fake_quantize_int4(w: Tensor) -> Tensor:
    """w: [out, in] -> dequantize_int4(quantize_int4(w)) in w's dtype, straight-through gradients."""
    return _FakeQuantInt4.apply(w)


def pack_int4(q: Tensor) -> Tensor:
    """q: int8 [out, in] in [-7, 7] -> int32 [out, ceil(in / 8)] (compressed-tensors' weight_packed)."""
    out, cols = q.shape
    words = math.ceil(cols / PACK)
    u = torch.nn.functional.pad(q.to(torch.int64) + 8, (0, words * PACK - cols)).view(out, words, PACK)
    shifts = torch.arange(PACK, dtype=torch.int64, device=q.device) * 4
    packed = (u << shifts).sum(dim=-1)  # < 2**32
    return torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)


def unpack_int4(packed: Tensor, in_features: int) -> Tensor:
    """packed: int32 [out, words] -> q: int8 [out, in_features]."""
    shifts = torch.arange(PACK, dtype=torch.int64, device=packed.device) * 4
    u = (packed.to(torch.int64).unsqueeze(-1) & 0xFFFFFFFF) >> shifts & 0xF
    return (u.view(packed.shape[0], -1)[:, :in_features] - 8).to(torch.int8)


def quantized_linears(model: torch.nn.Module) -> dict[str, torch.nn.Linear]:
    """The Linear layers both sides quantise, by qualified name: every `nn.Linear` but the
    output head (`get_output_embeddings()`, or a module named `lm_head`) and MoE routers
    (modules named `gate`, whose outputs pick experts)."""
    output_embeddings = getattr(model, "get_output_embeddings", None)  # a transformers model's
    head = output_embeddings() if output_embeddings is not None else None
    return {name: m for name, m in model.named_modules()
            if isinstance(m, torch.nn.Linear) and m is not head
            and name.rsplit(".", 1)[-1] not in ("lm_head", "gate")}
