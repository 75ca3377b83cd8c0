"""The built-in engine's model as loaded and served: `--dtype`, and `--quantization int4` or
`fp8`.

int4 (`precision.rollout: int4`; the format: core/quant/int4.py): every Linear that a trainer
with `precision.train: int4_qat` fake-quantises is served from int4 values (packed eight to an
int32, compressed-tensors' `weight_packed`) and float32 group scales, dequantised to `--dtype`
for each matmul: float32, or bfloat16 where the trainer computes int4_qat in bf16 (megatron on
GPUs: core/quant/modes.py int4_dtype). They are quantised with the trainer's own function from
the weights the engine loads or is pushed (any transport: disk, tensor, distributed), held in
`--dtype` as the trainer holds them, so the engine serves the trainer's fake-quantised weights
bit for bit. The pushed weights stay in the layer's
`weight`, the weight receiver's landing tensor (names, shapes, staging and memory release
work as for any model); no matmul reads them.

When: a layer re-quantises at its first forward after the live weights changed, which the
receiver counts (`WeightReceiver.generation`, bumped under model_lock by every swap, copy,
release and re-allocation). Forwards run under model_lock too, so a forward always computes
with the int4 form of the weights it would otherwise have used.

Refused at load: `--quantization int4` with a `--dtype` other than float32 or bfloat16 (the
dtypes an int4_qat trainer computes in). On the fast path (static_model.py) int4 projections
are not fused: each computes through its own module, and the decoder calls `prepare` before
every forward, outside any CUDA graph, so a stale layer re-quantises there, into the tensors
its captured graphs read (same addresses). A memory release of the weights frees the int4
values and scales too (`forget_int4`): what the engine holds while released is not a
quarter of its weights.

fp8 (`precision.rollout: fp8`; the format: core/quant/fp8.py, SGLang's and DeepSeek-V3's
block-wise e4m3 with 128 x 128 scales): every Linear weight that `served_in_fp8` picks is
stored as float8_e4m3fn `X.weight` plus float32 `X.weight_scale_inv`, both state-dict
entries, so pushes (the trainer quantises on sync: weight_sender.py) and disk loads fill them
like any tensor and the weights take half the memory of bf16. Each matmul dequantises the
weight to the input's dtype (no fp8 kernel: on CPU and GPU alike this stores fp8 and computes
in `--dtype`). At load, and for a disk load of an unquantised checkpoint (the trainer's
export), the engine quantises with the same function as the trainer, from the weights in
float32, so a pushed policy and the same policy loaded from disk are served bit for bit alike.
A float weight sent for an fp8 one (or the reverse) is refused by the receiver, never cast.

`/get_weights_by_name` (SGLang's route: `{name, truncate_size}` -> the tensor's first
`truncate_size` rows as float32 lists) answers with the weight a matmul uses: for an int4
or fp8 layer the dequantised one. Float32 values survive JSON exactly, so callers compare bits.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, cast

import torch
import torch.nn.functional as F
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from milepost.core.quant.fp8 import (
    FP8_DTYPE,
    compiled_dequantize_fp8_blockwise,
    dequantize_fp8_blockwise,
    quantize_fp8_blockwise,
    quantize_state_fp8,
    scale_name,
    served_in_fp8,
)
from milepost.core.quant.int4 import (
    compiled_dequantize_packed,
    dequantize_packed,
    pack_int4,
    quantize_int4,
    quantized_linears,
)
from milepost.core.weight_sync.packing import pack_parameters

if TYPE_CHECKING:  # types only: the scheduler imports the parts of the engine
    from milepost.core.engine.scheduler import Scheduler

QUANTIZATIONS = ("int4", "fp8")


class Int4Linear(torch.nn.Linear):
    """A Linear served from int4 values and scales (module doc); made from an nn.Linear in
    place by `serve_int4`, which sets the attributes below (plain attributes, not buffers:
    the state dict, which weight updates fill, keeps only `weight` and `bias`)."""

    weight_packed: torch.Tensor | None  # int32 [out, ceil(in / 8)]; None once forgotten
    weight_scale: torch.Tensor | None  # float32 [out, groups]
    generation: Callable[[], int]  # the receiver's count of live-weight changes
    quantized_at: int | None

    @torch.inference_mode()
    def refresh(self) -> None:
        """Quantise `weight` again, into the tensors held when they fit (captured CUDA
        graphs read them by address). Always in inference mode: the first forward after a
        release makes them there (the fast path decodes in it), and an inference tensor can
        only be written in it (a later refresh may come from /get_weights_by_name)."""
        q, scale = quantize_int4(self.weight)
        packed = pack_int4(q)
        if self.weight_packed is not None and self.weight_scale is not None \
                and self.weight_packed.shape == packed.shape and self.weight_packed.device == packed.device:
            self.weight_packed.copy_(packed)
            self.weight_scale.copy_(scale)
        else:
            self.weight_packed, self.weight_scale = packed, scale
        self.quantized_at = self.generation()

    def prepare(self) -> None:
        """Re-quantise if the live weights changed since the last quantisation."""
        if self.quantized_at != self.generation() or self.weight_packed is None:
            self.refresh()

    def forget(self) -> None:
        """Drop the int4 values and scales (a memory release); the next `prepare` makes them."""
        self.weight_packed = self.weight_scale = None
        self.quantized_at = None

    def served_weight(self) -> torch.Tensor:
        """The weight every matmul uses: [out, in], dequantised from the int4 values."""
        self.prepare()
        assert self.weight_packed is not None and self.weight_scale is not None  # prepare made them
        dequantize = compiled_dequantize_packed() if self.weight_packed.is_cuda else dequantize_packed
        return dequantize(self.weight_packed, self.weight_scale, self.in_features, self.weight.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.served_weight(), self.bias)


def serve_int4(model: torch.nn.Module, generation: Callable[[], int]) -> list[str]:
    """Turn every quantised Linear of `model` into an Int4Linear (its class swapped in place:
    same module, same parameters) and quantise it. Returns the layer names."""
    layers = quantized_linears(model)
    for layer in layers.values():
        if type(layer) is not torch.nn.Linear:
            raise TypeError(f"int4 serving expects plain nn.Linear layers, got {type(layer).__name__}")
        layer.__class__ = Int4Linear
        int4 = cast(Int4Linear, layer)  # what it now is
        int4.generation = generation
        int4.weight_packed = int4.weight_scale = None
        int4.refresh()
    return sorted(layers)


def forget_int4(model: torch.nn.Module) -> int:
    """Free every Int4Linear's int4 values and scales (the weights' memory release); returns
    how many layers held them."""
    held = [m for m in model.modules() if isinstance(m, Int4Linear) and m.weight_packed is not None]
    for layer in held:
        layer.forget()
    return len(held)


class Fp8Linear(torch.nn.Linear):
    """A Linear served from block-wise fp8 (module doc): `weight` float8_e4m3fn [out, in] and
    `weight_scale_inv` float32 [ceil(out / 128), ceil(in / 128)], both frozen parameters.
    Made from an nn.Linear in place by `serve_fp8`."""

    weight_scale_inv: torch.nn.Parameter

    def served_weight(self, dtype: torch.dtype) -> torch.Tensor:
        """The weight every matmul uses: [out, in] in `dtype`, dequantised."""
        dequantize = compiled_dequantize_fp8_blockwise() if self.weight.is_cuda else dequantize_fp8_blockwise
        return dequantize(self.weight, self.weight_scale_inv, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.served_weight(x.dtype), self.bias)


def fp8_linears(model: torch.nn.Module) -> dict[str, torch.nn.Linear]:
    """The Linears served in fp8, by qualified name: those whose weight `served_in_fp8` picks."""
    picked: dict[str, torch.nn.Linear] = {}
    for name, module in model.named_modules():
        weight = getattr(module, "weight", None)
        if isinstance(weight, torch.Tensor) and served_in_fp8(f"{name}.weight", weight.shape):
            if not isinstance(module, torch.nn.Linear):
                raise TypeError(f"fp8 serving quantises {name}.weight, which belongs to a "
                                f"{type(module).__name__}, not an nn.Linear")
            picked[name] = module
    return picked


def serve_fp8(model: torch.nn.Module, dtype: torch.dtype) -> list[str]:
    """Quantise every picked Linear of `model` (loaded in float32) to block-wise fp8, cast the
    rest to `dtype`, and turn the Linears into Fp8Linear (class swapped in place). Returns the
    layer names. The cast comes before the fp8 weights are set: Module.to(dtype) casts every
    floating-point tensor, float8 included."""
    layers = fp8_linears(model)
    quantized = {name: quantize_fp8_blockwise(layer.weight) for name, layer in layers.items()}
    model.to(dtype)
    for name, layer in layers.items():
        q, scale = quantized[name]
        layer.__class__ = Fp8Linear
        layer.weight = torch.nn.Parameter(q, requires_grad=False)
        layer.weight_scale_inv = torch.nn.Parameter(scale, requires_grad=False)
    return sorted(layers)


def served_state(model: torch.nn.Module, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A checkpoint's tensors (named as live) in the form `model` serves: an fp8 layer's weight
    given unquantised (the trainer's export) is quantised, as at load, and its scale added;
    one given in fp8 with its scale is taken as it is."""
    unquantised = {f"{name}.weight" for name, module in model.named_modules() if isinstance(module, Fp8Linear)
                   and f"{name}.weight" in state and state[f"{name}.weight"].dtype != FP8_DTYPE
                   and scale_name(f"{name}.weight") not in state}
    return quantize_state_fp8(state, unquantised)


def load_model(path: str, device: torch.device, dtype: torch.dtype, quantization: str | None,
               generation: Callable[[], int]) -> torch.nn.Module:
    """The engine's model from the HF folder `path`, on `device` in `dtype`, served with
    `quantization` (None, or one of QUANTIZATIONS)."""
    from transformers import AutoModelForCausalLM

    if quantization is not None and quantization not in QUANTIZATIONS:
        raise ValueError(f"--quantization {quantization}: the built-in engine serves {', '.join(QUANTIZATIONS)}")
    if quantization == "int4" and dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"--quantization int4 dequantises to the dtype the int4_qat trainer computes in, float32 or "
                         f"bfloat16, not {dtype}: pass --dtype float32 or --dtype bfloat16")
    if quantization == "fp8" and not dtype.is_floating_point:
        raise ValueError(f"--quantization fp8 dequantises to the model's --dtype, a float type, not {dtype}")
    # fp8 quantises from float32 weights, as the trainer's sender does (module doc)
    load_dtype = torch.float32 if quantization == "fp8" else dtype
    model = AutoModelForCausalLM.from_pretrained(path, dtype=load_dtype).eval()
    if device.type == "cuda" and quantization in (None, "int4"):  # int4 lands pushes in `weight` as they are
        # moved to the GPU laid out back to back, before the fast path fuses projections and
        # captures graphs over them: a pushed update is then committed in a few span copies
        # (packing.py). Where q/k/v are not adjacent in the state dict (Qwen2's biases lie
        # between them), the fusion moves them to a buffer of their own and their packed copy
        # stays unused: ~5 % of Qwen2-0.5B's weight memory, none for Qwen3 or Llama layouts.
        pack_parameters(model, device)
    model = model.to(device)  # buffers (rotary tables); packed parameters are there already
    if quantization == "int4":
        serve_int4(model, generation)
    elif quantization == "fp8":
        serve_fp8(model, dtype)
    return model


def served_rows(model: torch.nn.Module, name: str, truncate_size: int) -> list[Any]:
    """SGLang's get_weights_by_name: the first `truncate_size` rows of the tensor `name` as a
    matmul uses it, float32 (a tied lm_head is the embedding)."""
    module_name, _, leaf = name.rpartition(".")
    module = model.get_submodule(module_name) if module_name else model
    tensor: torch.Tensor | None
    if isinstance(module, Int4Linear) and leaf == "weight":
        tensor = module.served_weight()
    elif isinstance(module, Fp8Linear) and leaf == "weight":
        tensor = module.served_weight(torch.float32)
    else:
        tensor = model.state_dict().get(name)
        if tensor is None:
            raise KeyError(name)
    return tensor.detach().to("cpu", torch.float32).tolist()[:truncate_size]


def add_weights_route(app: FastAPI, sched: Scheduler) -> None:
    """`/get_weights_by_name` (an admin endpoint: the guard asks for the admin key)."""

    @app.api_route("/get_weights_by_name", methods=["GET", "POST"])
    async def get_weights_by_name(request: Request) -> Any:
        if not sched.ready:
            return JSONResponse({"error": {"message": "model is loading"}}, status_code=503)
        body = await request.json()
        name, size = body.get("name") if isinstance(body, dict) else None, 100
        if isinstance(body, dict) and body.get("truncate_size") is not None:
            size = body["truncate_size"]
        if not isinstance(name, str) or not isinstance(size, int):
            return JSONResponse({"error": {"message": "`name` (string) and `truncate_size` (int) expected"}},
                                status_code=400)

        def read() -> list[Any]:
            with sched.model_lock:
                return served_rows(sched.model, name, size)
        try:
            return JSONResponse(await asyncio.to_thread(read))
        except (KeyError, AttributeError):
            return JSONResponse({"error": {"message": f"Get parameter by name failed: no tensor {name!r}"}},
                                status_code=400)
