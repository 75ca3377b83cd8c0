"""FP8 casts for core/quant/fp8_linear.py: the recipe (`Fp8Recipe`: how operands are scaled),
the quantisation itself (`quantize`, `quantize_t`: pure functions, eager), its compiled form
on CUDA (`cast`), and the reuse of weight casts across the micro-batches of one schedule
(`weight_casts_reused`, `cast_weight`). Delayed scaling's casts: core/quant/fp8_delayed.py.

Scales: `scale_inv = amax / FP8_MAX` (what `_scaled_mm` multiplies by: its scale_a / scale_b
are dequantisation factors), amax clamped to 1e-12 so an all-zero row quantises to zeros.
"""

from __future__ import annotations

import contextlib
import functools
import types
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import Tensor

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
AMAX_FLOOR = 1e-12


@dataclass(frozen=True)
class Fp8Recipe:
    """How the FP8 linear scales. `wgrad_fp8=False` keeps the weight-gradient GEMM in bf16
    (torchao's `rowwise_with_gw_hp`: its reduction runs over all tokens of the micro-batch).
    `compile_casts`: on CUDA, each cast (`quantize`) is one torch.compile'd function: eager it is
    ~6 memory-bound passes over the tensor (abs, amax, float, mul, clamp, cast), which at the
    Qwen3-1.7B shape would cost about as much as fp8 saves in the GEMMs; compiled, two (the amax
    reduction, then scale + cast). Same arithmetic (a unit test checks bit equality on CPU); on
    CPU the casts stay eager (compile time would dominate the tests). `fast_accum`: the forward
    GEMM's `use_fast_accum` (CUDA: faster, less exact accumulation; torchao uses it in forward
    only), never in the gradient GEMMs. `eager_amax`: a compiled per-tensor cast takes its amax
    from one eager aten reduction (`tensor_amax`) instead of computing it in the compiled graph
    (same value; kept switchable so the bench measures both side by side). `amax_history`: 0,
    current scaling (each cast scales by its own amax); N > 0, tensorwise only: delayed
    scaling of activations and gradients from the last N amaxes of the same operand in the same
    layer (core/quant/fp8_delayed.py; the caller passes the layer's `AmaxHistory`).
    `cast_kernel`: how a compiled per-tensor cast runs on CUDA: "triton", one kernel launched
    directly (core/quant/fp8_triton.py: a fraction of a compiled call's host time, one read of
    the tensor for both layouts), or "inductor", `quantize_t` through torch.compile (kept so the
    bench measures both side by side). Rowwise casts always go through inductor.
    `e4m3_gradients`: tensorwise only, gradients in e4m3 (3 mantissa bits, range 2**-9..448
    of the tensor's amax) instead of e5m2 (2 bits, a wider range): half the rounding step, at
    the risk of flushing a gradient's smallest values to zero (rowwise always uses e4m3)."""

    scaling: Literal["rowwise", "tensorwise"] = "rowwise"
    wgrad_fp8: bool = True
    compile_casts: bool = True
    fast_accum: bool = False
    eager_amax: bool = True
    amax_history: int = 0
    cast_kernel: Literal["triton", "inductor"] = "triton"
    e4m3_gradients: bool = False

    def __post_init__(self) -> None:
        if self.amax_history < 0 or (self.amax_history and self.scaling != "tensorwise"):
            raise ValueError(f"Fp8Recipe amax_history {self.amax_history}: delayed scaling needs scaling "
                             "'tensorwise' and a history of N >= 1 amaxes (0: current scaling)")

    @property
    def grad_dtype(self) -> torch.dtype:
        return E4M3 if self.scaling == "rowwise" or self.e4m3_gradients else E5M2

    def describe(self) -> str:
        grad = "e4m3" if self.grad_dtype == E4M3 else "e5m2"
        return (f"{self.scaling} scales, e4m3 activations/weights, {grad} gradients, "
                f"wgrad in {'fp8' if self.wgrad_fp8 else 'bf16'}"
                + (", casts eager" if not self.compile_casts else "") + (", fast accum" if self.fast_accum else "")
                + (f", delayed scaling (amax history {self.amax_history})" if self.amax_history else "")
                + (", casts by inductor" if self.cast_kernel == "inductor" and self.scaling == "tensorwise" else ""))


def tensor_amax(x: Tensor) -> Tensor:
    """max |x| over the whole tensor, [] in x's dtype (exact: it is one of x's values). One eager
    reduction: on the H100 the compiled `x.abs().amax()` of a whole tensor read ~0.8 TB/s
    (inductor, dynamic shapes: 78 ms of the fp8 step's 0.71 s of kernels); with this instead the
    step was 3.3 % faster, side by side (bench/results/fp8_training_h100.txt, run 4)."""
    return torch.linalg.vector_norm(x, float("inf"))


def quantize(x: Tensor, dtype: torch.dtype, dim: int | None, amax: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """x: [R, C] -> (q: `dtype` [R, C], scale_inv: float32) with q * scale_inv ~ x.
    dim=1: one scale per row, scale_inv [R, 1]; dim=0: per column, [1, C]; None: per tensor, [].
    `amax`: per tensor only, `tensor_amax(x)` computed by the caller (else here)."""
    fmax = torch.finfo(dtype).max
    if amax is None:
        amax = x.abs().amax() if dim is None else x.abs().amax(dim=dim, keepdim=True)
    amax = amax.float().clamp(min=AMAX_FLOOR)
    q = (x.float() * (fmax / amax)).clamp(-fmax, fmax).to(dtype)
    return q, amax / fmax


Layout = Literal["row", "col", "both"]


def quantize_t(x: Tensor, dtype: torch.dtype, dim: int | None, layout: Layout = "row",
               amax: Tensor | None = None) -> tuple[Tensor, ...]:
    """`quantize` in the layout(s) the GEMMs read: "row" -> (q [R, C], s); "col" -> (q
    transposed to a contiguous [C, R], s transposed); "both" -> (q, q_t, s), per tensor only
    (dim None: one scale serves both). Compiled, each transposed copy fuses into the cast, so
    a tensor is cast once for every GEMM that reads it instead of cast, then transposed eagerly
    (an eager fp8 transpose is a separate, uncoalesced pass over the tensor)."""
    q, s = quantize(x, dtype, dim, amax)
    if layout == "row":
        return q, s
    if layout == "col":
        return q.t().contiguous(), s.t()
    if dim is not None:
        raise ValueError("quantize_t: layout 'both' needs one scale per tensor (dim None)")
    return q, q.t().contiguous(), s


def _eager_division_option() -> dict[str, str | int | bool | Callable[..., Any]]:
    """inductor's option for IEEE division, where this torch has it (2.13 does; older may not)."""
    import torch._inductor.config as inductor_config
    return ({"eager_numerics.division_rounding": True}
            if hasattr(getattr(inductor_config, "eager_numerics", None), "division_rounding") else {})


@functools.cache
def _compiled_quantize(dtype: torch.dtype, dim: int | None, layout: Layout = "row", eager_amax: bool = True) -> Any:
    """`quantize_t(·, dtype, dim, layout)` compiled, each combination with a code object of its
    own. Why: dynamo keeps its compiled graphs, and its limit of 8 (`recompile_limit`), per code
    object, and closures of one function share theirs: the combinations a run casts with (x, w
    and g, with and without backward, rowwise dims) and the grad modes they are called under
    went past 8, after which dynamo ran the rest EAGER, silently but for one warning.
    Per tensor (dim None) with `eager_amax`, the amax is `tensor_amax`, eager, and the compiled
    part is the scale, the cast and the transposed copy. Division as eager rounds it (IEEE
    round-to-nearest, inductor's `eager_numerics.division_rounding` where this torch has it):
    Triton's default `/` is approximate, and on the H100 1 in ~3,000 rowwise bytes came out one
    fp8 code away from the eager cast."""
    def quantize_one(x: Tensor, amax: Tensor | None) -> tuple[Tensor, ...]:
        return quantize_t(x, dtype, dim, layout, amax)
    tag = f"{str(dtype).removeprefix('torch.')}_{dim}_{layout}"
    own = types.FunctionType(quantize_one.__code__.replace(co_name=f"quantize_{tag}"), quantize_one.__globals__,
                             f"quantize_{tag}", None, quantize_one.__closure__)
    compiled = torch.compile(own, dynamic=True, options=_eager_division_option())
    if dim is None and eager_amax:
        return lambda x: compiled(x, tensor_amax(x))
    return lambda x: compiled(x, None)


def cast(x: Tensor, dtype: torch.dtype, dim: int | None, recipe: Fp8Recipe,
         layout: Layout = "row") -> tuple[Tensor, ...]:
    """`quantize_t`, compiled on CUDA when `recipe.compile_casts` (Fp8Recipe): per tensor by
    `recipe.cast_kernel` (the Triton kernel where its 32-bit offsets fit, else inductor), per row
    or column by inductor."""
    if recipe.compile_casts and x.is_cuda:
        if dim is None and recipe.cast_kernel == "triton":
            from milepost.core.quant import fp8_triton  # imports this module
            if fp8_triton.fits(x):
                return fp8_triton.cast_tensorwise(x, dtype, layout)
        return _compiled_quantize(dtype, dim, layout, recipe.eager_amax)(x)
    return quantize_t(x, dtype, dim, layout)


# Weight casts reused across micro-batches: {(id of the weight, cast): (weight, its _version, the cast)} while
# `weight_casts_reused()` is open, else None.
_WEIGHT_CASTS: dict[tuple[Any, ...], tuple[Tensor, int, tuple[Tensor, ...]]] | None = None


@contextlib.contextmanager
def weight_casts_reused() -> Iterator[None]:
    """Inside, each weight Parameter is cast once per (dtype, scale dim, layout) and the cast is
    reused by every later micro-batch; on leaving, the casts are dropped. Why: the weights do not
    change between the micro-batches of one forward-backward schedule, and at the Qwen3-1.7B
    shape re-casting them each micro-batch was a quarter of the fp8 step's casts (and of its
    compiled calls, which bound that step's host time). Rule: nothing may change a weight inside
    (the optimizer steps after the schedule: the megatron worker opens this around the schedule
    alone). An in-place change through the Parameter itself bumps its `_version` and is re-cast;
    one through `.data` is not seen, hence the rule. Nested opens share the outer cache."""
    global _WEIGHT_CASTS
    outer = _WEIGHT_CASTS
    if outer is None:
        _WEIGHT_CASTS = {}
    try:
        yield
    finally:
        _WEIGHT_CASTS = outer


def cast_weight(w: Tensor, dtype: torch.dtype, dim: int | None, recipe: Fp8Recipe,
                layout: Layout = "row") -> tuple[Tensor, ...]:
    """`cast` of a weight, reused inside `weight_casts_reused()`. Only Parameters are reused: a
    temporary's storage could be freed and its address given to another tensor."""
    cache = _WEIGHT_CASTS
    if cache is None or not isinstance(w, torch.nn.Parameter):
        return cast(w, dtype, dim, recipe, layout)
    key = (id(w), dtype, dim, layout, recipe.compile_casts)  # the entry holds w: its id stays its own
    hit = cache.get(key)
    if hit is not None and hit[0] is w and hit[1] == w._version:
        return hit[2]
    casts = cast(w, dtype, dim, recipe, layout)
    cache[key] = (w, w._version, casts)
    return casts
