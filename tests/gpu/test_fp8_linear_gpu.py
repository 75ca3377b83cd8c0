"""core/quant/fp8_linear.py on an FP8 GPU (compute capability >= 8.9): the CUDA `_scaled_mm`
kernels accept every GEMM layout and dtype the module builds (rowwise CUTLASS: mat1 e4m3 / e5m2,
mat2 e4m3, bf16 out; tensorwise cuBLASLt), and compute what the CPU reference kernel computes
from the same fp8 operands (only the accumulation order differs). Casts compiled on CUDA
(Fp8Recipe.compile_casts) must equal the eager ones bit for bit.

Run through the device tool: `python -m pytest -q -m gpu tests/gpu/test_fp8_linear_gpu.py`.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from milepost.core.quant.fp8_cast import E4M3, E5M2, Fp8Recipe, _compiled_quantize, quantize_t
from milepost.core.quant.fp8_linear import fp8_linear

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9), reason="needs an FP8 GPU")]

RECIPES = ("rowwise", "tensorwise", "rowwise-gw-bf16", "rowwise-fast")


def _recipe(name: str) -> Fp8Recipe:
    return {"rowwise": Fp8Recipe(), "tensorwise": Fp8Recipe("tensorwise"),
            "rowwise-gw-bf16": Fp8Recipe(wgrad_fp8=False), "rowwise-fast": Fp8Recipe(fast_accum=True)}[name]


def _run(device: str, recipe: Fp8Recipe, compile_casts: bool) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 1000, 512, generator=g).bfloat16()  # 3000 tokens: padded to 3008
    w = (torch.randn(768, 512, generator=g) * 0.05).bfloat16()
    grad = torch.randn(3, 1000, 768, generator=g).bfloat16()
    xg, wg = x.to(device).requires_grad_(), w.to(device).requires_grad_()
    y = fp8_linear(xg, wg, None, replace(recipe, compile_casts=compile_casts))
    y.backward(grad.to(device))
    return y.float().cpu(), xg.grad.float().cpu(), wg.grad.float().cpu()


@pytest.mark.parametrize("name", RECIPES)
def test_cuda_fp8_linear_matches_the_cpu_reference_kernel(name: str) -> None:
    recipe = _recipe(name)
    cpu = _run("cpu", recipe, compile_casts=False)
    for compile_casts in (False, True):
        cuda = _run("cuda", recipe, compile_casts)
        for what, a, b in zip(("y", "dgrad", "wgrad"), cuda, cpu):
            rel = float((a - b).norm() / b.norm())
            # same fp8 operands, different accumulation order and bf16 rounding of the sum:
            # ~2**-8 relative; fast accumulation (forward only) a little more
            assert rel < (2e-2 if recipe.fast_accum and what == "y" else 8e-3), (name, compile_casts, what, rel)


def test_compiled_casts_equal_eager_casts_bit_for_bit_on_cuda() -> None:
    x = torch.randn(3000, 2048, device="cuda", dtype=torch.bfloat16) * 3
    for dtype, dim, layout in ((E4M3, 1, "row"), (E4M3, 0, "col"), (E5M2, None, "row"), (E4M3, None, "both")):
        *qs, s = _compiled_quantize(dtype, dim, layout)(x)
        *qs0, s0 = quantize_t(x, dtype, dim, layout)
        q, q0 = (torch.cat([t.reshape(-1).view(torch.uint8) for t in ts]) for ts in (qs, qs0))
        differ = q.view(torch.uint8) != q0.view(torch.uint8)
        ulps = (q.view(torch.uint8).int() - q0.view(torch.uint8).int()).abs().max().item()
        print(f"\n{dtype} dim {dim}: {differ.float().mean().item():.2e} of the bytes differ (at most {ulps} "
              f"codes apart); scales equal: {torch.equal(s, s0)}")
        assert torch.equal(q.view(torch.uint8), q0.view(torch.uint8)) and torch.equal(s, s0), (dtype, dim)


def _bytes(ts: tuple[torch.Tensor, ...]) -> list[torch.Tensor]:
    return [t.view(torch.uint8) if t.dtype in (E4M3, E5M2) else t for t in ts]


@pytest.mark.parametrize("shape", [(3000, 2048), (3001, 520), (16, 16)])
def test_triton_cast_equals_the_eager_cast_bit_for_bit(shape: tuple[int, int]) -> None:
    from milepost.core.quant.fp8_triton import cast_tensorwise
    full = torch.randn(shape[0], shape[1] + 8, device="cuda", dtype=torch.bfloat16) * 3
    for x in (full[:, :shape[1]].contiguous(), full[:, :shape[1]]):  # and rows with a stride of their own
        for dtype in (E4M3, E5M2):
            for layout in ("row", "col", "both"):
                got, want = cast_tensorwise(x, dtype, layout), quantize_t(x, dtype, None, layout)
                assert all(torch.equal(a, b) for a, b in zip(_bytes(got), _bytes(want))), (shape, dtype, layout)
    zeros = torch.zeros(64, 256, device="cuda", dtype=torch.bfloat16)  # amax floor: zeros stay zeros
    assert all(torch.equal(a, b) for a, b in zip(_bytes(cast_tensorwise(zeros, E4M3, "both")),
                                                 _bytes(quantize_t(zeros, E4M3, None, "both"))))


def _without(cast: tuple[torch.Tensor, ...], nan: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """A "both" cast (q, q^T, scale) with the NaN positions of its input zeroed."""
    q, q_t, s = cast
    keep = (~nan).to(torch.uint8)
    return q.view(torch.uint8) * keep, q_t.view(torch.uint8) * keep.t(), s


def test_triton_delayed_cast_equals_the_eager_delayed_cast() -> None:
    from milepost.core.quant.fp8_delayed import AmaxHistory
    for length in (16, 5):  # the built-in recipe's, and one that is not a power of two
        mine, theirs = AmaxHistory(length), AmaxHistory(length)
        triton_cast = Fp8Recipe("tensorwise", amax_history=length)
        eager_cast = replace(triton_cast, compile_casts=False)
        for step in range(length + 4):  # past a whole turn of the ring; the amax rises and falls
            x = torch.randn(3001, 520, device="cuda", dtype=torch.bfloat16) * (step % 4 + 1)
            if step == 3:  # an inf, a -inf and a NaN: saturated / kept NaN, never recorded
                x[7, 9], x[3000, 519], x[1500, 0] = float("inf"), float("-inf"), float("nan")
            got = mine.caster("g")(x, E5M2, None, triton_cast, "both")
            want = theirs.caster("g")(x, E5M2, None, eager_cast, "both")
            if step == 3:  # a NaN's fp8 code may differ in its sign bit between the two: compare the rest
                got, want = (_without(c, x.isnan()) for c in (got, want))
            assert all(torch.equal(a, b) for a, b in zip(_bytes(got), _bytes(want))), (length, step)
            assert torch.equal(mine.records["g"], theirs.records["g"]), (length, step)


def test_inductor_and_triton_cast_kernels_give_the_same_linear() -> None:
    for recipe in (Fp8Recipe("tensorwise", fast_accum=True), Fp8Recipe("tensorwise")):
        runs = [_run("cuda", replace(recipe, cast_kernel=kernel), compile_casts=True)
                for kernel in ("triton", "inductor")]
        for what, a, b in zip(("y", "dgrad", "wgrad"), *runs):
            assert torch.equal(a, b), (recipe.describe(), what)
