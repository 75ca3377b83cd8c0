"""core/quant/fp8_delayed.py: delayed scaling's rules (first cast exact, later casts scaled
from the history and saturating, the history updated newest first), its refusals, and that
the compiled cast the GPU uses computes what the eager one computes."""

from __future__ import annotations

import pytest
import torch

from milepost.core.quant.fp8_cast import E4M3, E5M2, Fp8Recipe, quantize_t
from milepost.core.quant.fp8_delayed import AmaxHistory, _compiled_delayed, quantize_delayed
from milepost.core.quant.fp8_linear import fp8_linear

DELAYED = Fp8Recipe("tensorwise", amax_history=4)


def _x(scale: float = 1.0, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(48, 32, generator=g).bfloat16() * scale


def _bytes(q: torch.Tensor) -> torch.Tensor:
    return q.view(torch.uint8)


def test_the_first_cast_of_an_operand_is_the_current_scaling_cast() -> None:
    x, history = _x(), AmaxHistory(4)
    q, q_t, s = history.caster("x")(x, E4M3, None, DELAYED, "both")
    q0, q0_t, s0 = quantize_t(x, E4M3, None, "both")
    assert torch.equal(_bytes(q), _bytes(q0)) and torch.equal(_bytes(q_t), _bytes(q0_t)) and torch.equal(s, s0)


def test_a_later_cast_scales_from_the_history_saturates_above_it_and_records_its_own_amax() -> None:
    history = AmaxHistory(3)
    cast = history.caster("g")
    small, big = _x(1.0), _x(4.0, seed=1)
    cast(small, E5M2, None, DELAYED)
    q, s = cast(big, E5M2, None, DELAYED)  # scaled by small's amax: big's outliers saturate
    fmax = torch.finfo(E5M2).max
    assert torch.equal(s, small.abs().amax().float() / fmax)
    assert q.float().abs().max() == fmax
    expected = (big.float() * (fmax / small.abs().amax().float())).clamp(-fmax, fmax).to(E5M2)
    assert torch.equal(_bytes(q), _bytes(expected))
    records = history.records["g"]
    assert records.tolist() == [big.abs().amax().item(), small.abs().amax().item(), small.abs().amax().item()]
    q, s = cast(small, E5M2, None, DELAYED)  # the largest record (big's) now sets the scale
    assert torch.equal(s, big.abs().amax().float() / fmax)
    assert "x" not in history.records  # each operand its own records


def test_the_compiled_delayed_cast_equals_the_eager_one_bit_for_bit() -> None:
    x = torch.randn(77, 48, dtype=torch.bfloat16) * 5
    for dtype, layout in ((E4M3, "both"), (E5M2, "row"), (E5M2, "col")):
        start = torch.tensor([3.0, 7.5, 0.0])
        h_eager, h_compiled = start.clone(), start.clone()
        *qs, s = _compiled_delayed(dtype, layout)(x, h_compiled)
        *qs0, s0 = quantize_delayed(x, dtype, h_eager, layout)
        assert torch.equal(s, s0) and torch.equal(h_compiled, h_eager), (dtype, layout)
        assert all(torch.equal(_bytes(q), _bytes(q0)) for q, q0 in zip(qs, qs0, strict=True)), (dtype, layout)


def test_a_layer_with_steady_amaxes_trains_as_with_current_scaling() -> None:
    # the same batch twice: the history holds exactly its amaxes, so both passes cast as current scaling does
    g = torch.Generator().manual_seed(3)
    x, w, grad = torch.randn(2, 32, 64, generator=g), torch.randn(48, 64, generator=g) * 0.05, torch.randn(2, 32, 48)
    history = AmaxHistory(4)

    def run(recipe: Fp8Recipe, hist: AmaxHistory | None) -> list[torch.Tensor]:
        xg, wg = x.clone().requires_grad_(), w.clone().requires_grad_()
        y = fp8_linear(xg, wg, None, recipe, history=hist)
        y.backward(grad)
        return [y.detach(), xg.grad, wg.grad]

    current = run(Fp8Recipe("tensorwise"), None)
    for _ in range(2):
        delayed = run(DELAYED, history)
        assert all(torch.equal(a, b) for a, b in zip(delayed, current, strict=True))
    assert set(history.records) == {"x", "g"}


def test_delayed_scaling_is_refused_where_it_cannot_work() -> None:
    with pytest.raises(ValueError, match="tensorwise"):
        Fp8Recipe("rowwise", amax_history=4)
    with pytest.raises(ValueError, match="history of N >= 1"):
        Fp8Recipe("tensorwise", amax_history=-1)
    with pytest.raises(ValueError, match="AmaxHistory"):
        fp8_linear(_x().float(), _x().float()[:16], None, DELAYED)
    with pytest.raises(ValueError, match="at least 1"):
        AmaxHistory(0)
    assert "delayed scaling (amax history 4)" in DELAYED.describe()


def test_a_history_saved_and_loaded_casts_as_the_one_that_went_on() -> None:
    """The records are train state (the megatron worker checkpoints them): a loaded copy scales
    the next cast exactly as the original does; records of another length are refused."""
    torch.manual_seed(0)
    went_on = AmaxHistory(4)
    for scale in (1.0, 3.0):
        went_on.caster("x")(torch.randn(8, 16) * scale, E4M3, None, Fp8Recipe("tensorwise", amax_history=4))
    loaded = AmaxHistory(4)
    loaded.load_state(went_on.state(), torch.device("cpu"))
    x, recipe = torch.randn(8, 16), Fp8Recipe("tensorwise", amax_history=4)
    for a, b in zip(went_on.caster("x")(x, E4M3, None, recipe), loaded.caster("x")(x, E4M3, None, recipe)):
        assert torch.equal(a.float(), b.float())
    assert torch.equal(went_on.records["x"], loaded.records["x"])
    with pytest.raises(ValueError, match="do not fit a history of 8"):
        AmaxHistory(8).load_state(went_on.state(), torch.device("cpu"))


def test_the_records_stay_newest_first_through_many_turns_of_the_ring() -> None:
    """AmaxHistory keeps each operand's records in a ring of N + 2 slots: after any number of
    casts its records are the last N amaxes, newest first, and scale each cast by their max."""
    history, recipe = AmaxHistory(3), Fp8Recipe("tensorwise", amax_history=3)
    cast, seen = history.caster("x"), []
    for i in range(11):
        x = _x(scale=float(1 + (i * 7) % 5), seed=i)
        amax = x.abs().amax().float().item()
        _, s = cast(x, E4M3, None, recipe)
        expected_amax = max(seen[-3:]) if seen else amax
        assert s.item() == pytest.approx(expected_amax / torch.finfo(E4M3).max, rel=1e-6), i
        seen += [amax, amax] if not seen else [amax]  # the first cast starts the records from its amax, then records it
        assert history.records["x"].tolist() == (seen[::-1] + [0.0] * 3)[:3], i
    loaded = AmaxHistory(3)
    loaded.load_state(history.state(), torch.device("cpu"))
    assert torch.equal(loaded.records["x"], history.records["x"])


def test_an_inf_or_a_nan_is_never_recorded() -> None:
    """An inf record would cast every later tensor to zeros for N casts, with a finite loss."""
    history = AmaxHistory(3)
    cast = history.caster("x")
    cast(_x(), E4M3, None, DELAYED)
    before = history.records["x"].clone()
    bad = _x(2.0, seed=1)
    finite = bad.abs().amax().float()
    bad[0, 0], bad[1, 1], bad[2, 2] = float("inf"), float("-inf"), float("nan")
    q, s = cast(bad, E4M3, None, DELAYED)
    assert torch.equal(s, before.amax() / torch.finfo(E4M3).max)  # scaled by the records before it
    assert q[0, 0].float() == torch.finfo(E4M3).max and q[1, 1].float() == -torch.finfo(E4M3).max  # saturated
    assert torch.isnan(q[2, 2].float())
    records = history.records["x"]
    assert records[0] == finite and torch.equal(records[1:], before[:2])  # its finite amax, newest first
    q, s = cast(_x(), E4M3, None, DELAYED)
    assert torch.equal(s, finite / torch.finfo(E4M3).max) and torch.isfinite(q.float()).all()
    only_bad = torch.full((16, 16), float("nan"), dtype=torch.bfloat16)
    cast(only_bad, E4M3, None, DELAYED)
    assert history.records["x"][0] == 0.0  # nothing finite: no record
