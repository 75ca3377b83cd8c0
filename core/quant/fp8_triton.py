"""The per-tensor FP8 cast of core/quant/fp8_cast.py as one Triton kernel, launched directly
(`Fp8Recipe.cast_kernel == "triton"`, tensorwise scaling on CUDA; the default there).

Why a kernel of our own, when inductor compiles the same arithmetic: on the H100 at the
Qwen3-1.7B shape the fp8 step was host-bound (bench/results/fp8_profile_h100.txt: 0.65 s of
GPU kernels in a 0.79 s step). Each compiled cast cost ~100 us of host time (dynamo's guards,
AOTAutograd's wrappers, then inductor's launcher: bench/results/fp8_casts_gpu.txt, "host"),
~1,800 calls a step; a Triton launch costs a fraction of that. And inductor made two passes of
the both-layouts cast at dynamic shapes (q, then q^T read back from q); this kernel reads each
2-D tile of x once and writes it in both layouts, the transposed store coalesced by Triton's
layout conversion through shared memory. Only the cast: the GEMMs stay torch._scaled_mm.

The arithmetic is `fp8_cast.quantize`'s, operation for operation, so the bytes are the same:
scale = fmax * (1 / amax) (torch's `fmax / amax` of a tensor is `amax.reciprocal() * fmax`),
q = clamp(x_fp32 * scale, -fmax, fmax) rounded to nearest even, with IEEE division (`div_rn`);
scale_inv = amax * fp32(1 / fmax) (CUDA's `amax / fmax` by a Python number multiplies by the
number's float32 reciprocal; 1 / 448 is not exact, so a division would differ in the last
bit). tests/gpu/test_fp8_linear_gpu.py checks bit equality with the eager cast. Delayed
scaling (`amax_history`): the scale comes from the layer's records and the kernel records x's
own amax in the same pass (an atomic max over the tiles' amaxes), so a delayed cast is one
launch and one read of x, where current scaling needs an amax pass first.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import Tensor

from milepost.core.quant.fp8_cast import AMAX_FLOOR, Layout, tensor_amax

BLOCK_M, BLOCK_K = 64, 128  # a tile: 16 KB of bf16 read, 8 + 8 KB of fp8 written
MAX_ELEMENTS = 2**31 - 1  # the kernel's offsets are 32-bit; a larger tensor goes through inductor
FLOAT32_MAX = torch.finfo(torch.float32).max


def fits(x: Tensor) -> bool:
    """Whether the kernel can cast x (its offsets fit 32 bits)."""
    return x.numel() <= MAX_ELEMENTS and x.dim() == 2 and x.stride(0) * x.shape[0] <= MAX_ELEMENTS


@functools.cache
def _kernel() -> Any:
    """The cast kernel, defined on first use (CPU-only installs have no Triton)."""
    import triton
    import triton.language as tl

    @triton.jit(do_not_specialize=["write_slot", "clear_slot"])
    def fp8_cast_tile(x_ptr, q_ptr, qt_ptr, amax_ptr, ring_ptr, scale_inv_ptr, write_slot, clear_slot,
                      M, K, stride_xm,
                      FMAX: tl.constexpr, INV_FMAX: tl.constexpr, FLOOR: tl.constexpr, FINITE_MAX: tl.constexpr,
                      RING: tl.constexpr,
                      RING_P2: tl.constexpr, WRITE_Q: tl.constexpr, WRITE_QT: tl.constexpr,
                      BM: tl.constexpr, BK: tl.constexpr):
        pid_m, pid_k = tl.program_id(0), tl.program_id(1)
        if RING > 0:  # delayed scaling: the largest of the operand's records (all slots but the two in use)
            slots = tl.arange(0, RING_P2)
            kept = (slots < RING) & (slots != write_slot) & (slots != clear_slot)
            amax = tl.max(tl.load(ring_ptr + slots, mask=kept, other=0.0), axis=0)
        else:
            amax = tl.load(amax_ptr).to(tl.float32)
        amax = tl.maximum(amax, FLOOR)
        scale = tl.math.div_rn(1.0, amax) * FMAX
        if (pid_m == 0) & (pid_k == 0):
            tl.store(scale_inv_ptr, amax * INV_FMAX)
            if RING > 0:  # the oldest record leaves; its slot, read by no program here, is the next write's
                tl.store(ring_ptr + clear_slot, 0.0)
        rm = pid_m * BM + tl.arange(0, BM)
        rk = pid_k * BK + tl.arange(0, BK)
        mask = (rm[:, None] < M) & (rk[None, :] < K)
        x = tl.load(x_ptr + rm[:, None] * stride_xm + rk[None, :], mask=mask, other=0.0).to(tl.float32)
        q = tl.clamp(x * scale, -FMAX, FMAX).to(q_ptr.dtype.element_ty)
        if WRITE_Q:
            tl.store(q_ptr + rm[:, None] * K + rk[None, :], q, mask=mask)
        if WRITE_QT:
            tl.store(qt_ptr + rk[:, None] * M + rm[None, :], tl.trans(q), mask=tl.trans(mask))
        if RING > 0:  # x's own amax into the write slot (zeroed by the launch before): atomic max over tiles
            a = tl.abs(x)
            a = tl.where(a <= FINITE_MAX, a, 0.0)  # infs and NaNs are not recorded (fp8_delayed.finite_amax)
            tl.atomic_max(ring_ptr + write_slot, tl.max(tl.max(a, axis=1), axis=0))

    return fp8_cast_tile


def _launch(x: Tensor, dtype: torch.dtype, layout: Layout, amax: Tensor | None,
            ring: tuple[Tensor, int, int] | None) -> tuple[Tensor, ...]:
    """One launch of the kernel over x: [M, K] (unit inner stride) -> `quantize_t`'s outputs.
    Current scaling by `amax`, or delayed by `ring` (records, write slot, clear slot)."""
    if x.dim() != 2:
        raise ValueError(f"the triton fp8 cast takes a 2-D tensor, got shape {tuple(x.shape)}")
    if x.stride(1) != 1:
        x = x.contiguous()
    m, k = x.shape
    q = torch.empty((m, k), dtype=dtype, device=x.device) if layout != "col" else None
    q_t = torch.empty((k, m), dtype=dtype, device=x.device) if layout != "row" else None
    scale_inv = torch.empty((), dtype=torch.float32, device=x.device)
    records, write_slot, clear_slot = ring if ring is not None else (scale_inv, 0, 0)  # unread without a ring
    size = records.numel() if ring is not None else 0
    fmax, inv_fmax = _limits(dtype)
    grid = (-(-m // BLOCK_M), -(-k // BLOCK_K))
    _kernel()[grid](
        x, q if q is not None else q_t, q_t if q_t is not None else q,
        amax if amax is not None else scale_inv, records, scale_inv, write_slot, clear_slot, m, k, x.stride(0),
        FMAX=fmax, INV_FMAX=inv_fmax, FLOOR=AMAX_FLOOR, FINITE_MAX=FLOAT32_MAX,
        RING=size, RING_P2=max(2, 1 << (size - 1).bit_length()),
        WRITE_Q=q is not None, WRITE_QT=q_t is not None, BM=BLOCK_M, BK=BLOCK_K, num_warps=4)
    if layout == "row":
        return q, scale_inv  # type: ignore[return-value]
    if layout == "col":
        return q_t, scale_inv  # type: ignore[return-value]
    return q, q_t, scale_inv  # type: ignore[return-value]


@functools.cache
def _limits(dtype: torch.dtype) -> tuple[float, float]:
    """(dtype's largest value, 1 / it rounded to float32: what CUDA's `amax / fmax` multiplies by)."""
    fmax = torch.finfo(dtype).max
    return fmax, float(torch.tensor(1.0, dtype=torch.float32) / torch.tensor(fmax, dtype=torch.float32))


def cast_tensorwise(x: Tensor, dtype: torch.dtype, layout: Layout = "row") -> tuple[Tensor, ...]:
    """`fp8_cast.quantize_t(x, dtype, None, layout)` on CUDA: current scaling, x's amax by one
    eager reduction (`tensor_amax`), then one kernel pass for the cast in `layout`."""
    return _launch(x, dtype, layout, tensor_amax(x), None)


def cast_delayed(x: Tensor, dtype: torch.dtype, ring: Tensor, write_slot: int, clear_slot: int,
                 layout: Layout = "row") -> tuple[Tensor, ...]:
    """Delayed scaling's cast on CUDA (`fp8_delayed.AmaxHistory` keeps the records as a ring):
    scaled by the largest record in `ring` (float32, every slot but the two named), x's own amax
    recorded in `write_slot` (zero before), `clear_slot` zeroed for the next cast. One launch,
    nothing else: no amax pass before the cast, no roll of the records after it."""
    return _launch(x, dtype, layout, None, (ring, write_slot, clear_slot))
