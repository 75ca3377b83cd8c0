"""core/quant/fp8_linear.py and fp8_cast.py on CPU (torch._scaled_mm's reference kernel: the GPU's code).

Error bounds, stated per element and checked against a float64 reference of the same inputs:
an fp8 value is the input times (1 + e) plus at most half a subnormal step times its scale,
|e| <= 2**-4 (e4m3: 3 mantissa bits) or 2**-3 (e5m2), so for a GEMM of a [M, K] and b [K, N]
  |out - a @ b| <= ((1+ea)|a| + da) @ ((1+eb)|b| + db) - |a| @ |b|  +  2**-8 |out|
(the last term: the bf16 output's rounding), plus float32 accumulation slack.
"""

from __future__ import annotations

import pytest
import torch

from milepost.core.quant.fp8_cast import (
    E4M3,
    E5M2,
    Fp8Recipe,
    _compiled_quantize,
    quantize,
    quantize_t,
    weight_casts_reused,
)
from milepost.core.quant.fp8_linear import ALIGN, forward_gemm, fp8_linear, fp8_shape_problem, grad_cast

REL = {E4M3: 2.0**-4, E5M2: 2.0**-3}
HALF_SUBNORMAL = {E4M3: 2.0**-10, E5M2: 2.0**-17}
RECIPES = [Fp8Recipe(), Fp8Recipe("tensorwise"), Fp8Recipe(wgrad_fp8=False),
           Fp8Recipe("tensorwise", e4m3_gradients=True)]


def _inputs(m: int = 37, k: int = 64, n: int = 48, seed: int = 0) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(2, m, k, generator=g)
    x[0, 3] *= 30.0  # an outlier token
    w = torch.randn(n, k, generator=g) * 0.05
    b = torch.randn(n, generator=g)
    grad = torch.randn(2, m, n, generator=g)
    return x, w, b, grad


def _slack(t: torch.Tensor, dtype: torch.dtype, dim: int | None) -> tuple[float, torch.Tensor]:
    """(relative error bound, absolute bound per element) of quantising t with `quantize`."""
    _, scale_inv = quantize(t, dtype, dim)
    return REL[dtype], (scale_inv * HALF_SUBNORMAL[dtype]).expand_as(t).double()


def _bound(a: torch.Tensor, da: tuple, b: torch.Tensor, db: tuple, out: torch.Tensor) -> torch.Tensor:
    """The module docstring's bound for out ~ a @ b (a: [M, K], b: [K, N])."""
    a, b = a.double().abs(), b.double().abs()
    exact = a @ b
    return ((1 + da[0]) * a + da[1]) @ ((1 + db[0]) * b + db[1]) - exact + 2.0**-8 * out.double().abs() + 1e-6


def _reference(x, w, b, grad):
    xr, wr, br = (t.double().requires_grad_() for t in (x, w, b))
    yr = torch.nn.functional.linear(xr, wr, br)
    yr.backward(grad.double())
    return yr.detach(), xr.grad, wr.grad, br.grad


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda r: r.describe())
def test_forward_and_both_gradients_are_within_the_fp8_error_bound_of_float64(recipe) -> None:
    x, w, b, grad = _inputs()
    xg, wg, bg = (t.clone().requires_grad_() for t in (x, w, b))
    y = fp8_linear(xg, wg, bg, recipe)
    y.backward(grad)
    yr, gxr, gwr, gbr = _reference(x, w, b, grad)
    rowwise = recipe.scaling == "rowwise"
    x2, g2 = x.reshape(-1, 64), grad.reshape(-1, 48)
    fwd = _bound(x2, _slack(x2, E4M3, 1 if rowwise else None), w.t(),
                 tuple(s.t() if torch.is_tensor(s) else s for s in _slack(w, E4M3, 1 if rowwise else None)),
                 y.reshape(-1, 48) - b)
    assert (y.reshape(-1, 48).double() - yr.reshape(-1, 48)).abs().le(fwd).all()
    gd = recipe.grad_dtype
    dgrad = _bound(g2, _slack(g2, gd, 1 if rowwise else None), w, _slack(w, E4M3, 0 if rowwise else None),
                   xg.grad.reshape(-1, 64))
    assert (xg.grad.reshape(-1, 64).double() - gxr.reshape(-1, 64)).abs().le(dgrad).all()
    if recipe.wgrad_fp8:
        da = tuple(s.t() if torch.is_tensor(s) else s for s in _slack(g2, gd, 0 if rowwise else None))
        wgrad = _bound(g2.t(), da, x2, _slack(x2, E4M3, 0 if rowwise else None), wg.grad)
    else:  # bf16 operands (2**-8 each) and output
        wgrad = 3 * 2.0**-8 * (g2.double().abs().t() @ x2.double().abs()) + 1e-6
    assert (wg.grad.double() - gwr).abs().le(wgrad).all()
    torch.testing.assert_close(bg.grad, gbr.float())  # the bias gradient is a plain (float32) sum
    assert (y.dtype, xg.grad.dtype, wg.grad.dtype) == (torch.float32,) * 3


def test_typical_relative_errors_are_a_few_percent_and_e4m3_gradients_beat_e5m2() -> None:
    # measured: rowwise 2.7 % / 3.6 % / 3.2 % (forward / dgrad / wgrad, relative Frobenius error),
    # tensorwise 2.5 % / 5.9 % / 5.6 %: two e4m3 roundings cost ~2.5 % whatever the scaling (e4m3
    # is floating point: a 30x outlier token does not push the others out of its normal range);
    # gradients in e5m2 (2 mantissa bits) cost ~1.6x e4m3's
    x, w, b, grad = _inputs(m=256, k=128, n=96, seed=1)
    yr, gxr, gwr, _ = _reference(x, w, b, grad)

    def rel(a: torch.Tensor, r: torch.Tensor) -> float:
        return float((a.detach().double() - r).norm() / r.norm())

    errs = {}
    for name, recipe in (("rowwise", RECIPES[0]), ("tensorwise", RECIPES[1]), ("tensorwise-e4m3", RECIPES[3])):
        xg, wg = x.clone().requires_grad_(), w.clone().requires_grad_()
        y = fp8_linear(xg, wg, b, recipe)
        y.backward(grad)
        errs[name] = (rel(y, yr), rel(xg.grad, gxr), rel(wg.grad, gwr))
    assert all(e < 0.04 for e in errs["rowwise"]), errs
    assert all(e < 0.07 for e in errs["tensorwise"]), errs
    assert errs["rowwise"][1] < errs["tensorwise"][1] and errs["rowwise"][2] < errs["tensorwise"][2], errs
    # e4m3 gradients under one scale a tensor: the forward unchanged, both gradients closer
    assert errs["tensorwise-e4m3"][0] == errs["tensorwise"][0], errs
    assert all(errs["tensorwise-e4m3"][i] < errs["tensorwise"][i] for i in (1, 2)), errs


def test_quantize_scales_each_row_column_or_tensor_to_the_format_max() -> None:
    x = torch.tensor([[1.0, -2.0, 0.5], [0.0, 0.0, 0.0], [300.0, 1.0, -1.0]])
    q, s = quantize(x, E4M3, 1)
    assert s.shape == (3, 1) and q.dtype == E4M3
    assert q.float().abs().amax(dim=1).tolist() == [448.0, 0.0, 448.0]  # the all-zero row stays zero
    torch.testing.assert_close(s.squeeze(1), torch.tensor([2.0 / 448, 1e-12 / 448, 300.0 / 448]))
    q0, s0 = quantize(x, E4M3, 0)
    assert s0.shape == (1, 3) and q0.float().abs().amax(dim=0).tolist() == [448.0, 448.0, 448.0]
    qt, st = quantize(x, E5M2, None)
    assert st.shape == () and qt.dtype == E5M2
    torch.testing.assert_close(st, torch.tensor(300.0 / 57344.0))
    torch.testing.assert_close(q.float() * s, x, rtol=2.0**-4, atol=0.0)


def test_scaled_mm_multiplies_by_the_scales_it_is_given() -> None:
    # the convention fp8_linear relies on: _scaled_mm's scales dequantise ((a * sa) @ (b * sb))
    a = torch.eye(16).to(E4M3)
    b = (torch.ones(16, 16) * 2).to(E4M3)
    out = torch._scaled_mm(a, b.t(), scale_a=torch.full((16, 1), 3.0), scale_b=torch.full((1, 16), 0.5),
                           out_dtype=torch.bfloat16)
    assert torch.equal(out, torch.full((16, 16), 3.0, dtype=torch.bfloat16))


def test_token_counts_that_are_not_multiples_of_16_are_padded_and_give_the_unpadded_rows() -> None:
    x, w, b, _ = _inputs(m=48)
    full = fp8_linear(x, w, b)
    for m in (1, 5, 17, 33):  # rowwise scales are per token: the padded rows change nothing
        assert torch.equal(fp8_linear(x[:, :m], w, b), full[:, :m])


@pytest.mark.parametrize("shape,problem", [
    ((48, 64), None), ((40, 64), "out_features 40"), ((48, 60), "in_features 60"),
    ((33, 70), "out_features 33 and in_features 70")])
def test_shape_problem_names_each_feature_dim_that_is_not_a_multiple_of_16(shape, problem) -> None:
    got = fp8_shape_problem(*shape)
    assert got == (None if problem is None else f"{problem} not a multiple of {ALIGN} (torch._scaled_mm)")


def test_odd_feature_dims_fall_back_to_bf16_with_the_same_gradients_as_a_bf16_linear() -> None:
    x = torch.randn(3, 7, 60)
    w, b = torch.randn(40, 60) * 0.1, torch.randn(40)
    xg, wg = x.clone().requires_grad_(), w.clone().requires_grad_()
    y = fp8_linear(xg, wg, b)
    y.sum().backward()
    xh, wh = x.clone().requires_grad_(), w.clone().requires_grad_()
    ref = torch.nn.functional.linear(xh.bfloat16(), wh.bfloat16(), b.bfloat16()).float()
    ref.sum().backward()
    assert torch.equal(y, ref) and torch.equal(xg.grad, xh.grad) and torch.equal(wg.grad, wh.grad)
    with pytest.raises(ValueError, match="bf16 fallback .* does not all-reduce dgrad"):
        fp8_linear(x, w, b, allreduce_dgrad=True)


def test_under_bf16_autocast_the_output_is_bf16_and_gradients_keep_the_fp32_master_dtype() -> None:
    x, w, b, grad = _inputs()
    xg, wg = x.clone().requires_grad_(), w.clone().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = fp8_linear(xg, wg, b)
    assert y.dtype == torch.bfloat16
    y.backward(grad.bfloat16())
    assert xg.grad.dtype == wg.grad.dtype == torch.float32


def test_a_frozen_weight_gets_no_gradient_and_the_input_still_does() -> None:
    x, w, _, grad = _inputs()
    xg = x.clone().requires_grad_()
    fp8_linear(xg, w, None).backward(grad)
    assert xg.grad is not None and w.grad is None


def test_the_compiled_casts_the_gpu_uses_equal_the_eager_ones_bit_for_bit() -> None:
    # Fp8Recipe.compile_casts compiles `quantize` on CUDA; compiled here on CPU (inductor) to
    # check the arithmetic is unchanged, on a token count that is not a multiple of anything
    # (per tensor, both ways of taking the amax: eager by default, in the compiled graph on request)
    x = torch.randn(77, 48, dtype=torch.bfloat16) * 5
    for dtype, dim, layout, eager_amax in ((E4M3, 0, "col", True), (E5M2, None, "row", True),
                                           (E5M2, None, "both", True), (E4M3, None, "both", False)):
        *qs, s = _compiled_quantize(dtype, dim, layout, eager_amax)(x)
        *qs0, s0 = quantize_t(x, dtype, dim, layout)
        assert len(qs) == len(qs0) and torch.equal(s, s0)
        assert all(torch.equal(q.view(torch.uint8), q0.view(torch.uint8)) for q, q0 in zip(qs, qs0))


def test_every_cast_combination_stays_compiled(caplog) -> None:
    """Dynamo keeps its graphs, and a limit of 8, per code object: each combination has its
    own, so all of them, under both grad modes, compile (none falls back to eager)."""
    from torch._dynamo.utils import counters

    combos = [(E4M3, None, "both"), (E4M3, None, "row"), (E5M2, None, "both"), (E5M2, None, "col"),
              (E4M3, 1, "row"), (E4M3, 0, "col"), (E5M2, 1, "row"), (E5M2, 0, "col")]
    frames = dict(counters["frames"])
    for grad_mode in (True, False):
        with torch.set_grad_enabled(grad_mode):
            for combo in combos:
                _compiled_quantize(*combo)(torch.randn(32, 48, dtype=torch.bfloat16))
    assert "recompile_limit" not in caplog.text
    compiled = counters["frames"]["ok"] - frames.get("ok", 0)
    attempted = counters["frames"]["total"] - frames.get("total", 0)
    assert compiled == attempted, (compiled, attempted)


def test_a_per_tensor_cast_in_both_layouts_is_the_row_cast_and_its_transpose() -> None:
    x = torch.randn(40, 24) * 3
    q, q_t, s = quantize_t(x, E4M3, None, "both")
    q0, s0 = quantize(x, E4M3, None)
    assert torch.equal(q.view(torch.uint8), q0.view(torch.uint8)) and torch.equal(s, s0)
    assert q_t.is_contiguous() and torch.equal(q_t.view(torch.uint8), q0.t().view(torch.uint8))
    with pytest.raises(ValueError, match="one scale per tensor"):
        quantize_t(x, E4M3, 1, "both")


def test_tensorwise_casts_each_operand_once_in_only_the_layouts_its_gradients_read() -> None:
    x, w, _, grad = _inputs(m=32)
    x2, g2, tensorwise = x.reshape(-1, x.shape[-1]), grad.reshape(-1, grad.shape[-1]), Fp8Recipe("tensorwise")
    _, (xq_t, _, wq_t, _) = forward_gemm(x2, w, tensorwise, need_dgrad=True, need_wgrad=False)
    assert xq_t is None and wq_t is not None and wq_t.shape == (w.shape[1], w.shape[0])
    _, (xq_t, _, wq_t, _) = forward_gemm(x2, w, tensorwise, need_dgrad=False, need_wgrad=True)
    assert wq_t is None and xq_t.shape == (x2.shape[1], x2.shape[0])
    gq, gq_t, _ = grad_cast(g2, tensorwise, need_dgrad=True, need_wgrad=True)
    assert gq.shape == g2.shape and gq_t.shape == g2.t().shape
    assert grad_cast(g2, Fp8Recipe("tensorwise", wgrad_fp8=False), True, True)[1] is None
    assert grad_cast(g2, tensorwise, need_dgrad=False, need_wgrad=True)[0] is None
    # a frozen weight: the forward makes no x^T (no wgrad will read it)
    xg = x.clone().requires_grad_()
    y = fp8_linear(xg, w, None, tensorwise)
    y.backward(grad)
    assert xg.grad is not None and xg.grad.shape == x.shape


def _count_casts(monkeypatch: pytest.MonkeyPatch) -> list[torch.Size]:
    import milepost.core.quant.fp8_cast as fp8  # cast_weight casts through it
    shapes: list[torch.Size] = []
    real = fp8.cast

    def counting(t: torch.Tensor, *args, **kwargs):
        shapes.append(t.shape)
        return real(t, *args, **kwargs)
    monkeypatch.setattr(fp8, "cast", counting)
    return shapes


@pytest.mark.parametrize("recipe", [Fp8Recipe(), Fp8Recipe("tensorwise")], ids=["rowwise", "tensorwise"])
def test_inside_one_schedule_each_weight_is_cast_once_and_every_micro_batch_gets_the_same_result(
        recipe, monkeypatch) -> None:
    x, w0, b, grad = _inputs(m=32)
    micro_batches = [(x * (i + 1), grad * (i + 1)) for i in range(3)]

    def run(reuse: bool) -> tuple[list[torch.Tensor], torch.Tensor]:
        w = torch.nn.Parameter(w0.clone())
        outs = []
        with weight_casts_reused() if reuse else torch.enable_grad():
            for xm, gm in micro_batches:
                xm = xm.clone().requires_grad_()
                y = fp8_linear(xm, w, b, recipe)
                y.backward(gm)
                outs += [y.detach(), xm.grad]
        return outs, w.grad

    fresh, fresh_wgrad = run(reuse=False)
    shapes = _count_casts(monkeypatch)
    reused, reused_wgrad = run(reuse=True)
    assert all(torch.equal(a, b) for a, b in zip(fresh, reused, strict=True)) and torch.equal(fresh_wgrad, reused_wgrad)
    weight_casts = [s for s in shapes if s == w0.shape]
    # rowwise casts a weight twice per micro-batch (per row forward, per column for dgrad), tensorwise once
    assert len(weight_casts) == (2 if recipe.scaling == "rowwise" else 1)


def test_a_weight_changed_in_place_or_after_the_schedule_is_cast_again(monkeypatch) -> None:
    x, w0, _, _ = _inputs(m=32)
    w, recipe = torch.nn.Parameter(w0.clone()), Fp8Recipe("tensorwise")
    shapes = _count_casts(monkeypatch)
    with torch.no_grad():
        with weight_casts_reused():
            y0 = fp8_linear(x, w, None, recipe)
            w.mul_(2.0)  # through the Parameter: its _version moves
            y1 = fp8_linear(x, w, None, recipe)
        w.data.mul_(0.5)  # the optimizer's way, between schedules
        with weight_casts_reused():
            y2 = fp8_linear(x, w, None, recipe)
    assert len([s for s in shapes if s == w0.shape]) == 3
    assert not torch.equal(y0, y1) and torch.equal(y0, y2)
    # a plain tensor (not a Parameter) is never reused: its storage may be another tensor's next time
    shapes.clear()
    with weight_casts_reused(), torch.no_grad():
        fp8_linear(x, w0, None, recipe)
        fp8_linear(x, w0, None, recipe)
    assert len([s for s in shapes if s == w0.shape]) == 2


def test_the_megatron_build_log_counts_each_bf16_fallback_reason_once() -> None:
    from milepost.core.train.megatron.fp8 import Fp8Layers
    odd = "in_features 120 not a multiple of 16 (torch._scaled_mm)"
    layers = Fp8Layers(fp8=["decoder.layers.0.self_attention.linear_qkv"],
                       bf16={"output_layer": "kept in bf16: the output layer",
                             "decoder.layers.0.mlp.linear_fc2": odd, "decoder.layers.1.mlp.linear_fc2": odd})
    assert layers.describe() == ("1 linear layer(s) through torch._scaled_mm, 3 in bf16 (2 layer(s): in_features 120 "
                                 "not a multiple of 16 (torch._scaled_mm); 1 layer(s): kept in bf16: the output layer)")


def test_the_triton_cast_takes_what_its_32_bit_offsets_reach_and_imports_without_triton() -> None:
    from milepost.core.quant.fp8_triton import fits  # Triton itself is imported only at a launch
    assert fits(torch.empty(32768, 12288, device="meta"))
    assert not fits(torch.empty(2**16, 2**15, device="meta"))  # 2**31 elements: inductor casts it
    assert not fits(torch.empty(4, 8, 16, device="meta"))  # the kernel casts matrices
