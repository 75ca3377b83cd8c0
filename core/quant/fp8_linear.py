"""FP8 training linear: `y = x @ w.T (+ bias)` with all three GEMMs (forward, dgrad, wgrad)
through `torch._scaled_mm`, dynamic ("current") scaling, bf16 GEMM output. Pure functions and
one autograd.Function; the same code runs on CPU (torch's reference kernel: emulated, slow,
for tests) and on CUDA devices of compute capability >= 8.9 (FP8 tensor cores).

Scaling (`Fp8Recipe.scaling`):
- `rowwise` (default): one scale per row of each GEMM operand along its reduction dim (per
  token for activations, per output feature for the forward weight, per input feature for the
  dgrad weight, per output / input feature over the tokens for wgrad). Why: an outlier token
  or channel only coarsens its own row, so e4m3 (3 mantissa bits) serves gradients too: that
  is torchao's `rowwise` recipe and DeepSeek-V3's choice of e4m3 everywhere. `_scaled_mm`
  takes scale_a [M, 1], scale_b [1, N] on CPU and, through its CUTLASS kernel, on sm89 / sm90
  (H100 / H200), which takes mat1 e4m3 or e5m2 and mat2 e4m3, and only bf16 output.
- `tensorwise`: one scale per tensor (cuBLASLt's FP8 path, every FP8 GPU). One scale must
  cover a whole gradient tensor's range, so gradients go in e5m2 (range 2**-16..57344, 2
  mantissa bits), Transformer Engine's HYBRID format. Each operand is cast once per
  micro-batch: the forward's casts of x and w also write the transposed copies backward reads
  (x^T for wgrad, w^T for dgrad), and the gradient is cast once for both its GEMMs
  (`_scaled_mm` on CUDA reads mat1 row-major and mat2 column-major only, so every GEMM needs
  its operands laid out for it; fused into a compiled cast, a transposed copy costs a write,
  where an eager transpose of an fp8 tensor is another uncoalesced pass).
The casts themselves (and `Fp8Recipe`): core/quant/fp8_cast.py; delayed scaling:
core/quant/fp8_delayed.py.

Shapes `_scaled_mm` refuses on CUDA (any operand dim not a multiple of 16): the token dim is
zero-padded (exact: zero rows add nothing to any GEMM); feature dims that are not multiples
of 16 are static, so `fp8_shape_problem` names them and `fp8_linear` computes that layer in
bf16 instead (core/train/megatron/fp8.py logs each such layer once, at build).
Master weights: `weight` is whatever the trainer holds (bf16 parameters with fp32 masters in
megatron's optimizer on GPU; fp32 parameters on CPU); gradients come back in its dtype.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal, Protocol

import torch
import torch.nn.functional as F
from torch import Tensor

from milepost.core.quant.fp8_cast import E4M3, Fp8Recipe, cast, cast_weight

ALIGN = 16  # _scaled_mm on CUDA: every operand dim a multiple of 16
GEMM_OUT = torch.bfloat16  # rowwise _scaled_mm on CUDA outputs bf16 only
DEFAULT_RECIPE = Fp8Recipe()  # frozen: one instance serves every call


class ScaleHistory(Protocol):
    """A layer's scaling state for delayed scaling (core/quant/fp8_delayed.AmaxHistory): a cast
    with `cast`'s signature for its input ("x") or its output gradient ("g")."""

    def caster(self, role: Literal["x", "g"]) -> Callable[..., tuple[Tensor, ...]]: ...


def fp8_shape_problem(out_features: int, in_features: int) -> str | None:
    """Why a [out, in] weight cannot go through `_scaled_mm` (CUDA wants multiples of 16), or None."""
    bad = [f"{name} {n}" for name, n in (("out_features", out_features), ("in_features", in_features)) if n % ALIGN]
    return None if not bad else f"{' and '.join(bad)} not a multiple of {ALIGN} (torch._scaled_mm)"


def _pad_rows(x: Tensor) -> Tensor:
    """x: [M, C] -> [ceil(M / 16) * 16, C], zero rows appended."""
    extra = -x.shape[0] % ALIGN
    return F.pad(x, (0, 0, 0, extra)) if extra else x


def _mm(a: Tensor, sa: Tensor, b_t: Tensor, sb_t: Tensor, fast_accum: bool = False) -> Tensor:
    """a: fp8 [M, K] (row-major), sa: [M, 1] or []; b_t: fp8 [N, K] (row-major), sb_t: [N, 1]
    or [] -> bf16 [M, N] = (a * sa) @ (b_t * sb_t).T. `b_t.t()` is the column-major mat2
    `_scaled_mm` wants, and its scale the transposed [1, N]. Scales are rebuilt with unit
    inner strides: `_scaled_mm` checks strides (on CPU as on CUDA), and a transposed [1, N]
    keeps a stride of N along its size-1 dim that `.contiguous()` does not change."""
    if sa.dim():
        sa, sb_t = sa.reshape(-1)[:, None], sb_t.reshape(-1)[None, :]
    try:
        return torch._scaled_mm(a, b_t.t(), scale_a=sa, scale_b=sb_t, out_dtype=GEMM_OUT, use_fast_accum=fast_accum)
    except RuntimeError as exc:
        # torch before 2.13 has no rowwise scales on CPU (its mkldnn kernel is per-tensor only):
        # the same product in float32, as that kernel computes it
        if a.is_cuda or "per-tensor scaling for CPU" not in str(exc):
            raise
        return ((a.float() * sa) @ (b_t.float() * sb_t.t()).t()).to(GEMM_OUT)


def _cast_per_tensor(t: Tensor, dtype: torch.dtype, recipe: Fp8Recipe,
                     transposed_too: bool, caster: Callable[..., tuple[Tensor, ...]] = cast,
                     ) -> tuple[Tensor, Tensor | None, Tensor]:
    """One per-tensor cast of t: [R, C] -> (q [R, C], q^T [C, R] or None, scale_inv []), by
    `caster` (`cast`, or `cast_weight` for a weight)."""
    if transposed_too:
        q, q_t, s = caster(t, dtype, None, recipe, "both")
        return q, q_t, s
    q, s = caster(t, dtype, None, recipe)
    return q, None, s


def forward_gemm(x: Tensor, w: Tensor, recipe: Fp8Recipe, need_dgrad: bool = True, need_wgrad: bool = True,
                 history: ScaleHistory | None = None) -> tuple[Tensor, tuple[Tensor | None, ...]]:
    """x: [M, K] (M a multiple of 16), w: [N, K] -> (y bf16 [M, N], what backward needs).
    rowwise: (x, w), recast in backward along the other dim. tensorwise: the forward casts in
    the layouts backward reads, (x^T [K, M] for wgrad, its scale, w^T [K, N] for dgrad, its
    scale), each made by the same cast as the forward operand; one no gradient needs is None."""
    if recipe.scaling == "rowwise":
        xq, xs = cast(x, E4M3, 1, recipe)
        wq, ws = cast_weight(w, E4M3, 1, recipe)
        return _mm(xq, xs, wq, ws, recipe.fast_accum), (x, w)
    xq, xq_t, xs = _cast_per_tensor(x, E4M3, recipe, need_wgrad, history.caster("x") if history else cast)
    wq, wq_t, ws = _cast_per_tensor(w, E4M3, recipe, need_dgrad, cast_weight)
    return _mm(xq, xs, wq, ws, recipe.fast_accum), (xq_t, xs, wq_t, ws)


def grad_cast(g: Tensor, recipe: Fp8Recipe, need_dgrad: bool, need_wgrad: bool,
              history: ScaleHistory | None = None) -> tuple[Tensor | None, ...]:
    """g: [M, N] -> what the gradient GEMMs read of it. tensorwise: one cast, (g_q [M, N] for
    dgrad or None, g_q^T [N, M] for an fp8 wgrad or None, scale_inv). rowwise: (g,) (each GEMM
    scales it along its own reduction dim, so each casts it)."""
    if recipe.scaling == "rowwise":
        return (g,)
    fp8_wgrad = need_wgrad and recipe.wgrad_fp8
    caster = history.caster("g") if history else cast
    if need_dgrad and fp8_wgrad:
        return caster(g, recipe.grad_dtype, None, recipe, "both")
    gq, gs = caster(g, recipe.grad_dtype, None, recipe, "row" if need_dgrad else "col")
    return (gq, None, gs) if need_dgrad else (None, gq, gs)


def _made(*casts: Tensor | None) -> list[Tensor]:
    """The casts a gradient GEMM reads, each made because that gradient is needed."""
    made = [t for t in casts if t is not None]
    if len(made) != len(casts):
        raise RuntimeError("fp8_linear: a cast a gradient GEMM reads was not made (needs_input_grad changed?)")
    return made


def dgrad_gemm(gc: tuple[Tensor | None, ...], saved: tuple[Tensor | None, ...], recipe: Fp8Recipe) -> Tensor:
    """`grad_cast`'s g: [M, N] -> bf16 [M, K] = g @ w."""
    if recipe.scaling == "rowwise":
        g, w = _made(gc[0], saved[1])
        gq, gs = cast(g, recipe.grad_dtype, 1, recipe)  # per token
        wq_t, ws_t = cast_weight(w, E4M3, 0, recipe, "col")  # per input feature: g @ w's columns
        return _mm(gq, gs, wq_t, ws_t)
    gq, gs, wq_t, ws = _made(gc[0], gc[2], saved[2], saved[3])
    return _mm(gq, gs, wq_t, ws)


def wgrad_gemm(gc: tuple[Tensor | None, ...], saved: tuple[Tensor | None, ...], recipe: Fp8Recipe) -> Tensor:
    """`grad_cast`'s g: [M, N] -> bf16 [N, K] = g.T @ x, reduced over the M tokens."""
    if recipe.scaling == "rowwise":
        g, x = _made(gc[0], saved[0])
        gq_t, gs_t = cast(g, recipe.grad_dtype, 0, recipe, "col")  # per output feature, over tokens
        xq_t, xs_t = cast(x, E4M3, 0, recipe, "col")  # per input feature, over the tokens
        return _mm(gq_t, gs_t, xq_t, xs_t)
    gq_t, gs, xq_t, xs = _made(gc[1], gc[2], saved[0], saved[1])
    return _mm(gq_t, gs, xq_t, xs)


def _bf16_wgrad(g: Tensor, saved: tuple[Tensor | None, ...], recipe: Fp8Recipe) -> Tensor:
    """wgrad in bf16 (Fp8Recipe.wgrad_fp8 False): g: [M, N] -> [N, K]."""
    if recipe.scaling == "rowwise":
        (x,) = _made(saved[0])
    else:
        xq_t, xs = _made(saved[0], saved[1])
        x = xq_t.t().float() * xs
    return g.to(GEMM_OUT).t().matmul(x.to(GEMM_OUT))


class Fp8LinearFunction(torch.autograd.Function):
    """y = x @ w.T + bias with FP8 GEMMs; optional all-reduce of dgrad over a tensor-parallel
    group (megatron's ColumnParallelLinear does it inside its linear function, so ours must)."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, weight: Tensor, bias: Tensor | None, recipe: Fp8Recipe,
                allreduce_dgrad: bool, tp_group: Any, grad_on: bool = True,
                history: ScaleHistory | None = None) -> Tensor:
        lead, k = x.shape[:-1], x.shape[-1]
        x2 = x.reshape(-1, k)
        m = x2.shape[0]
        # grad_on: the caller's grad mode (forward itself runs without); under no_grad (the old
        # policy's logprobs) no backward comes, so no transposed casts are made for it
        need_dgrad, need_wgrad = grad_on and ctx.needs_input_grad[0], grad_on and ctx.needs_input_grad[1]
        y, saved = forward_gemm(_pad_rows(x2), weight, recipe, need_dgrad, need_wgrad, history)
        ctx.save_for_backward(*saved)
        ctx.recipe, ctx.m, ctx.lead, ctx.allreduce_dgrad, ctx.tp_group = recipe, m, lead, allreduce_dgrad, tp_group
        ctx.history = history
        ctx.x_dtype, ctx.w_dtype, ctx.has_bias = x.dtype, weight.dtype, bias is not None
        out_dtype = torch.get_autocast_dtype(x.device.type) if torch.is_autocast_enabled(x.device.type) else x.dtype
        y = y[:m].to(out_dtype)
        if bias is not None:
            y = y + bias.to(out_dtype)
        return y.reshape(*lead, weight.shape[0])

    @staticmethod
    def backward(ctx: Any, grad_out: Tensor) -> tuple[Tensor | None, ...]:
        saved, recipe, m = ctx.saved_tensors, ctx.recipe, ctx.m
        g = _pad_rows(grad_out.reshape(m, -1))
        need_dgrad, need_wgrad = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        gc = grad_cast(g, recipe, need_dgrad, need_wgrad, ctx.history)
        grad_x = grad_w = grad_b = None
        handle = None
        if need_dgrad:
            grad_x = dgrad_gemm(gc, saved, recipe)[:m].to(ctx.x_dtype).reshape(*ctx.lead, -1)
            if ctx.allreduce_dgrad:  # overlapped with wgrad, as megatron does
                handle = torch.distributed.all_reduce(grad_x, group=ctx.tp_group, async_op=True)
        if need_wgrad:
            grad_w = wgrad_gemm(gc, saved, recipe) if recipe.wgrad_fp8 else _bf16_wgrad(g, saved, recipe)
            grad_w = grad_w.to(ctx.w_dtype)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_b = grad_out.reshape(m, -1).sum(dim=0)
        if handle is not None:
            handle.wait()
        return grad_x, grad_w, grad_b, None, None, None, None, None

    @staticmethod
    def run(x: Tensor, weight: Tensor, bias: Tensor | None, recipe: Fp8Recipe, allreduce_dgrad: bool = False,
            tp_group: Any = None, history: ScaleHistory | None = None) -> Tensor:
        """`apply`, told the caller's grad mode. `history`: the layer's, for delayed scaling
        (`recipe.amax_history` > 0: required), else None."""
        if recipe.amax_history and history is None:
            raise ValueError("Fp8Recipe amax_history > 0 (delayed scaling) keeps state per layer: pass the layer's "
                             "AmaxHistory (core/quant/fp8_delayed.py; megatron's fp8 layers own one each)")
        out: Tensor = Fp8LinearFunction.apply(x, weight, bias, recipe, allreduce_dgrad, tp_group,
                                              torch.is_grad_enabled(), history if recipe.amax_history else None)
        return out


def bf16_linear(x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    """The fallback: x: [..., K], weight: [N, K] -> [..., N] computed in bf16, returned in the
    dtype an fp8 linear would return (autocast's, else x's)."""
    y = F.linear(x.to(torch.bfloat16), weight.to(torch.bfloat16), None if bias is None else bias.to(torch.bfloat16))
    out_dtype = torch.get_autocast_dtype(x.device.type) if torch.is_autocast_enabled(x.device.type) else x.dtype
    return y.to(out_dtype)


def fp8_linear(x: Tensor, weight: Tensor, bias: Tensor | None = None, recipe: Fp8Recipe = DEFAULT_RECIPE,
               allreduce_dgrad: bool = False, tp_group: Any = None, history: ScaleHistory | None = None) -> Tensor:
    """x: [..., K], weight: [N, K], bias: [N] or None -> [..., N] through FP8 GEMMs, or in bf16
    when `fp8_shape_problem(N, K)` says `_scaled_mm` would refuse the weight's shape. Output
    dtype: the autocast dtype under autocast, else x's."""
    problem = fp8_shape_problem(*weight.shape)
    if problem is not None:
        if allreduce_dgrad:
            raise ValueError(f"fp8_linear's bf16 fallback ({problem}) does not all-reduce dgrad; compute this "
                             "tensor-parallel layer with megatron's own linear")
        return bf16_linear(x, weight, bias)
    return Fp8LinearFunction.run(x, weight, bias, recipe, allreduce_dgrad, tp_group, history)
