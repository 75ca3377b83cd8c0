"""Delayed scaling for the per-tensor FP8 casts of core/quant/fp8_cast.py
(`Fp8Recipe.amax_history` > 0, tensorwise scaling only).

Current scaling (the default) reads each tensor twice: once for its amax, once to cast it with
the scale that amax gives. Delayed scaling casts with a scale known before the tensor is read:
the largest amax of the last N casts of the same operand in the same layer. The cast records
its own amax for the casts after it, in the same pass over the tensor (on CUDA one Triton
launch, core/quant/fp8_triton.py; one compiled graph where that kernel does not apply). This is Transformer Engine's
default recipe (amax history, max) and torchao's `delayed` one.

Rules, and the code that keeps them:
- Each fp8 layer owns one `AmaxHistory`: its input `x` and its output gradient `g` each have
  N records, newest first, float32 on the layer's device. Weights keep current scaling (they
  are cast once per forward-backward schedule anyway: `weight_casts_reused`).
- A record starts from its operand's first cast, which therefore scales by its own amax, as
  current scaling does (a zero or arbitrary start would clip or waste range on the first step).
- A value above the scale's amax saturates at the format's largest value: the clamp is part of
  every delayed cast, where current scaling could not overflow.
- A cast records the largest finite |value| of its tensor (`finite_amax`): an inf or a NaN
  is never recorded (the cast itself saturates an inf and keeps a NaN a NaN). Why: an inf
  record would set every later scale to 0 for N casts, so the layer's input would be cast to
  zeros, a finite loss trained on garbage with nothing to see (Transformer Engine keeps the
  previous scale on a non-finite amax, for the same reason).
- Each operand's records live in a ring (`AmaxHistory`'s docstring), so a cast on CUDA is one
  Triton launch: no roll of the records after it.
- Histories are part of the train state: the megatron worker writes them with each checkpoint
  (`fp8_rank<r>.pt`, core/train/megatron/fp8.py `amax_histories`) and puts them back on a resume,
  so a resumed run casts, and trains, bit for bit as the run that went on. A checkpoint without
  them (written by current scaling, or by another tensor-parallel layout) starts them again.
"""

from __future__ import annotations

import functools
import types
from collections.abc import Callable
from typing import Literal

import torch
from torch import Tensor

from milepost.core.quant.fp8_cast import (
    AMAX_FLOOR,
    Fp8Recipe,
    Layout,
    _eager_division_option,
)

Role = Literal["x", "g"]


def finite_amax(x: Tensor) -> Tensor:
    """The largest finite |value| of x as a float32 [] (0 when none is): infs and NaNs are
    left out (this module's rules; the Triton cast records the same)."""
    a = x.abs()
    return torch.where(torch.isfinite(a), a, torch.zeros_like(a)).amax().float()


def quantize_delayed(x: Tensor, dtype: torch.dtype, history: Tensor, layout: Layout = "row") -> tuple[Tensor, ...]:
    """x: [R, C], history: float32 [N] (newest first) -> `quantize_t`'s outputs for `layout`
    ("row": (q, s); "col": (q^T contiguous, s); "both": (q, q^T, s)) with s = max(history) /
    dtype max; then x's own amax (`finite_amax`) is recorded in `history` (in place, the oldest
    dropped)."""
    fmax = torch.finfo(dtype).max
    amax = history.amax().clamp(min=AMAX_FLOOR)
    q = (x.float() * (fmax / amax)).clamp(-fmax, fmax).to(dtype)
    scale_inv = amax / fmax
    history.copy_(torch.cat([finite_amax(x).reshape(1), history[:-1]]))
    if layout == "row":
        return q, scale_inv
    if layout == "col":
        return q.t().contiguous(), scale_inv
    return q, q.t().contiguous(), scale_inv


@functools.cache
def _compiled_delayed(dtype: torch.dtype, layout: Layout) -> Callable[[Tensor, Tensor], tuple[Tensor, ...]]:
    """`quantize_delayed(·, dtype, ·, layout)` compiled, with a code object of its own per
    combination (dynamo's recompile limit is per code object: fp8_cast._compiled_quantize)."""
    def quantize_one(x: Tensor, history: Tensor) -> tuple[Tensor, ...]:
        return quantize_delayed(x, dtype, history, layout)
    tag = f"delayed_{str(dtype).removeprefix('torch.')}_{layout}"
    own = types.FunctionType(quantize_one.__code__.replace(co_name=tag), quantize_one.__globals__, tag, None,
                             quantize_one.__closure__)
    compiled: Callable[[Tensor, Tensor], tuple[Tensor, ...]] = torch.compile(
        own, dynamic=True, options=_eager_division_option())
    return compiled


class AmaxHistory:
    """One fp8 layer's amax records (the rules in this module's docstring).

    Kept per operand as a ring of N + 2 float32 slots and a count of its casts c: the records of
    casts c-1 .. c-N sit in slots (c-1) % R .. (c-N) % R (R = N + 2); the slot c % R is zero and
    takes cast c's amax; the slot (c+1) % R holds the record leaving and is zeroed by cast c.
    Why two spare slots: the Triton cast (core/quant/fp8_triton.py) reads the records, writes
    its own amax and retires the oldest in one launch, its programs running in any order, so
    the slot written and the slot cleared must be ones no program reads. `records` and
    `state()` give the records newest first, as `quantize_delayed` takes them."""

    def __init__(self, length: int) -> None:
        if length < 1:
            raise ValueError(f"an amax history needs at least 1 record, got {length}")
        self.length = length
        self._rings: dict[Role, Tensor] = {}
        self._casts: dict[Role, int] = {}

    def _ring(self, role: Role, x: Tensor) -> Tensor:
        """`role`'s ring, started from x's own amax at the operand's first cast (as a cast that
        recorded it: c = 1, slot 0)."""
        ring = self._rings.get(role)
        if ring is None or ring.device != x.device:
            ring = torch.zeros(self.length + 2, dtype=torch.float32, device=x.device)
            ring[0] = finite_amax(x)
            self._rings[role], self._casts[role] = ring, 1
        return ring

    def _newest_first(self, role: Role) -> Tensor:
        """The N records of `role`, newest first: [N] float32, a copy."""
        ring, c, size = self._rings[role], self._casts[role], self.length + 2
        order = torch.tensor([(c - 1 - i) % size for i in range(self.length)], device=ring.device)
        return ring[order]

    @property
    def records(self) -> dict[Role, Tensor]:
        """Each operand's records, newest first ([N] float32 copies); empty before any cast."""
        return {role: self._newest_first(role) for role in self._rings}

    def clear(self) -> None:
        """Forget every record (the next cast of each operand starts them again)."""
        self._rings, self._casts = {}, {}

    def state(self) -> dict[str, Tensor]:
        """The records, by operand, newest first, copied to the CPU (for a checkpoint)."""
        return {role: t.detach().cpu().clone() for role, t in self.records.items()}

    def load_state(self, state: dict[str, Tensor], device: torch.device) -> None:
        """Records saved by `state()`, on `device`; ValueError when their length is not this history's."""
        rings: dict[Role, Tensor] = {}
        for role, t in state.items():
            if role not in ("x", "g") or t.shape != (self.length,):
                raise ValueError(f"amax records {role!r} of shape {tuple(t.shape)} do not fit a history of "
                                 f"{self.length}")
            ring = torch.zeros(self.length + 2, dtype=torch.float32, device=device)
            ring[:self.length] = t.to(device=device, dtype=torch.float32).flip(0)  # c = N: newest in slot N-1
            rings["x" if role == "x" else "g"] = ring
        self._rings, self._casts = rings, dict.fromkeys(rings, self.length)

    def caster(self, role: Role) -> Callable[..., tuple[Tensor, ...]]:
        """A cast with `fp8_cast.cast`'s signature that scales `role`'s operand from these
        records (per tensor only: the recipe's scaling is tensorwise)."""
        def delayed_cast(t: Tensor, dtype: torch.dtype, dim: int | None, recipe: Fp8Recipe,
                         layout: Layout = "row") -> tuple[Tensor, ...]:
            if dim is not None:
                raise ValueError("delayed scaling is per tensor: Fp8Recipe(scaling='tensorwise', amax_history=N)")
            ring = self._ring(role, t)
            c, size = self._casts[role], self.length + 2
            write_slot, clear_slot = c % size, (c + 1) % size
            compiled = recipe.compile_casts and t.is_cuda
            if compiled and recipe.cast_kernel == "triton":
                from milepost.core.quant import fp8_triton  # imports fp8_cast
                if fp8_triton.fits(t):
                    out = fp8_triton.cast_delayed(t, dtype, ring, write_slot, clear_slot, layout)
                    self._casts[role] = c + 1
                    return out
            # eager (CPU) or inductor: on the records newest first, the new one written back to the ring
            history = self._newest_first(role)
            out = (_compiled_delayed(dtype, layout)(t, history) if compiled
                   else quantize_delayed(t, dtype, history, layout))
            ring[write_slot], ring[clear_slot] = history[0], 0.0
            self._casts[role] = c + 1
            return out
        return delayed_cast
