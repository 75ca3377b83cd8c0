"""Block-wise FP8 (e4m3) weight quantisation, the format of DeepSeek-V3 checkpoints and of
SGLang's `fp8` block quantisation: pure tensor functions. precision.rollout fp8 uses them on
both sides: the trainer's weight sender quantises on sync (core/train/weight_sender.py), the
built-in engine stores and serves the result (core/engine/quantized.py), and both pick the
tensors by `served_in_fp8`.

Format, per 2-D weight `w: [out, in]` named `X.weight`:
- `X.weight`: float8_e4m3fn [out, in];
- `X.weight_scale_inv`: float32 [ceil(out / 128), ceil(in / 128)], one per 128 x 128 block
  (a ragged edge block is smaller: zero-padded for its max, cut back after);
- the weight meant is `X.weight.float() * X.weight_scale_inv` broadcast over each block
  (SGLang `block_quant_dequant`, transformers `_dequantize_fp8_weight`): despite its name
  the stored scale is the dequantisation factor, `max |block| / 448`;
- config.json: `quantization_config = {"quant_method": "fp8", "fmt": "e4m3",
  "activation_scheme": "dynamic", "weight_block_size": [128, 128]}` (QUANTIZATION_CONFIG).

Arithmetic (transformers' FineGrainedFP8 quantiser, so its output matches bit for bit on
block-aligned shapes): `mult = 448 / amax` (1 for an all-zero block), `q = clamp(w * mult,
-448, 448)` cast to e4m3 (round to nearest even), `weight_scale_inv = 1 / mult`, all float32.
Error: |dequantised - w| <= |w| * 2**-4 + weight_scale_inv * 2**-10 per element (3 mantissa
bits; e4m3's smallest subnormal is 2**-9), plus float32 rounding.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence

import torch
from torch import Tensor

BLOCK = 128
FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max
SCALE_SUFFIX = "_scale_inv"
UNQUANTISED = ("gate", "shared_expert_gate")  # Linears in a layer that pick or weigh experts
QUANTIZATION_CONFIG = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                       "weight_block_size": [BLOCK, BLOCK]}


def scale_shape(out_features: int, in_features: int) -> tuple[int, int]:
    """Shape of `weight_scale_inv` for a weight [out, in]: [ceil(out / 128), ceil(in / 128)]."""
    return math.ceil(out_features / BLOCK), math.ceil(in_features / BLOCK)


def _blocks(x: Tensor) -> Tensor:
    """x: [out, in] -> [out_blocks, 128, in_blocks, 128], zero-padded."""
    out, cols = x.shape
    rb, cb = scale_shape(out, cols)
    x = torch.nn.functional.pad(x, (0, cb * BLOCK - cols, 0, rb * BLOCK - out))
    return x.view(rb, BLOCK, cb, BLOCK)


def quantize_fp8_blockwise(w: Tensor) -> tuple[Tensor, Tensor]:
    """w: [out, in] (any float dtype) -> (float8_e4m3fn [out, in], weight_scale_inv float32
    [ceil(out / 128), ceil(in / 128)])."""
    if w.dim() != 2:
        raise ValueError(f"block-wise fp8 takes a 2-D Linear weight, got shape {list(w.shape)}")
    blocks = _blocks(w.detach().float())
    mult = _multipliers(blocks)
    scaled = (blocks * mult[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX)
    q = scaled.view(blocks.shape[0] * BLOCK, -1)[:w.shape[0], :w.shape[1]].to(FP8_DTYPE)
    return q.contiguous(), (1.0 / mult).to(torch.float32)


def _multipliers(blocks: Tensor) -> Tensor:
    """blocks: [out_blocks, 128, in_blocks, 128] float32 -> 448 / amax per block (1 where all zero)."""
    amax = blocks.abs().amax(dim=(1, 3))
    nonzero = amax > 0
    return torch.where(nonzero, FP8_MAX / torch.where(nonzero, amax, 1.0), 1.0)


def block_scale_inv(w: Tensor) -> Tensor:
    """The `weight_scale_inv` that quantize_fp8_blockwise(w) returns, without quantising the
    values (one read of w): a sender whose scales travel apart from the weights uses it."""
    if w.dim() != 2:
        raise ValueError(f"block-wise fp8 takes a 2-D Linear weight, got shape {list(w.shape)}")
    return (1.0 / _multipliers(_blocks(w.detach().float()))).to(torch.float32)


def served_in_fp8(name: str, shape: Sequence[int]) -> bool:
    """Whether precision.rollout fp8 serves the tensor `name` (HF naming) in block-wise fp8:
    a 2-D `.weight` inside a decoder layer (`….layers.<i>.…`), except MoE routers
    (`….gate.weight`: their outputs pick experts) and Qwen2-MoE's shared-expert gate (SGLang
    builds both unquantised). Embeddings, the output head, norms and
    biases stay in the engine's dtype. The rule goes by name so that both sides apply the
    same one: the trainer may hold HF-named tensors only (Megatron's gathered weights); the
    engine checks that each tensor it picks is an nn.Linear's weight."""
    parts = name.split(".")
    return len(shape) == 2 and parts[-1] == "weight" and "layers" in parts[:-2] and parts[-2] not in UNQUANTISED


def dequantize_fp8_blockwise(q: Tensor, scale_inv: Tensor, dtype: torch.dtype = torch.float32) -> Tensor:
    """q: float8_e4m3fn [out, in], scale_inv: float32 [ceil(out/128), ceil(in/128)] -> [out, in] in `dtype`."""
    out, cols = q.shape
    if tuple(scale_inv.shape) != scale_shape(out, cols):
        raise ValueError(f"weight_scale_inv of a [{out}, {cols}] weight has shape {list(scale_shape(out, cols))}, "
                         f"got {list(scale_inv.shape)}")
    blocks = _blocks(q.float()) * scale_inv.float()[:, None, :, None]
    return blocks.view(scale_inv.shape[0] * BLOCK, -1)[:out, :cols].to(dtype)


@functools.cache
def compiled_dequantize_fp8_blockwise() -> Callable[[Tensor, Tensor, torch.dtype], Tensor]:
    """`dequantize_fp8_blockwise` as one compiled kernel. Why: an fp8 engine on a GPU
    dequantises every weight at every forward, and eagerly that is three passes or more (the
    float32 copy, the padding of a ragged edge, the product, the cast) moving ~19 bytes a
    weight where one kernel reads 1 byte and writes the dtype's 2. On the lent H100 fp8
    rollout ran at 0.45x bf16's tok/s eagerly and 0.91x compiled
    (bench/results/rollout_precision_gpu.txt). One float32 product and one cast per element,
    so its bits are the eager function's (tests/unit/test_quant_fp8.py on CPU,
    tests/gpu/test_engine_gpu.py on CUDA)."""
    return torch.compile(dequantize_fp8_blockwise, dynamic=True)


def scale_name(weight_name: str) -> str:
    """`X.weight` -> `X.weight_scale_inv` (the checkpoint name SGLang and transformers read)."""
    if not weight_name.endswith(".weight"):
        raise ValueError(f"{weight_name!r} is not a `.weight` tensor")
    return weight_name + SCALE_SUFFIX


def quantize_state_fp8(state: dict[str, Tensor], names: set[str]) -> dict[str, Tensor]:
    """`state` with each weight in `names` (2-D `X.weight`) replaced by its e4m3 values and
    `X.weight_scale_inv` added; every other tensor unchanged (norms, embeddings, the head)."""
    out: dict[str, Tensor] = {}
    for name, t in state.items():
        if name in names:
            out[name], out[scale_name(name)] = quantize_fp8_blockwise(t)
        else:
            out[name] = t
    return out
