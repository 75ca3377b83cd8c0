"""RolloutAhead's contract: the staleness bound, exactly-once accounting, regeneration."""

from __future__ import annotations

import threading
import time

import pytest

from milepost.core.data.source import DataCursor, PromptSource
from milepost.core.rollout_ahead import Chunk, RolloutAhead, RolloutError
from milepost.core.types import Prompt, Sample

PROMPTS_PER_STEP = 3


def _source(num_rows: int = 30) -> PromptSource:
    rows = [{"prompt": f"{i}+0=", "label": str(i)} for i in range(num_rows)]
    return PromptSource(rows, None, DataCursor(0, 0, 7, num_rows), shuffle=True)


class Engine:
    """Stands in for rollout + reward: records the policy version each chunk started under."""

    def __init__(self, ahead_ref: list, abort_first_try: set[int] = frozenset()) -> None:
        self.ahead_ref, self.abort_first_try = ahead_ref, set(abort_first_try)
        self.started: dict[int, list[int]] = {}
        self.lock = threading.Lock()

    def __call__(self, index: int, prompts: list[Prompt]) -> list[Sample]:
        version = self.ahead_ref[0]._version
        with self.lock:
            self.started.setdefault(index, []).append(version)
        reason = "abort" if index in self.abort_first_try and len(self.started[index]) == 1 else "stop"
        return [Sample(prompt_index=p.index, group_index=g, prompt_ids=[1], response_ids=[2],
                       engine_logprobs=[0.0], loss_mask=[1], finish_reason=reason,
                       weight_version=str(version), label=p.label) for g, p in enumerate(prompts)]


def _ahead(max_staleness: int, engine_kw: dict | None = None, **kw) -> tuple[RolloutAhead, Engine]:
    ref: list = []
    engine = Engine(ref, **(engine_kw or {}))
    ahead = RolloutAhead(kw.pop("source", None) or _source(), engine, prompts_per_step=PROMPTS_PER_STEP,
                         max_staleness=max_staleness, policy_version=kw.pop("policy_version", 0),
                         next_chunk=kw.pop("next_chunk", 0), **kw)
    ref.append(ahead)
    return ahead, engine


def _train(ahead: RolloutAhead, steps: range) -> list[Chunk]:
    taken = []
    for step in steps:
        chunk = ahead.take(step - 1, timeout_s=10)
        taken.append(chunk)
        ahead.advance(step)  # the step's weights are now served
    return taken


@pytest.mark.parametrize("max_staleness", [0, 1, 2])
def test_no_chunk_starts_more_than_max_staleness_versions_before_it_is_trained(max_staleness):
    ahead, engine = _ahead(max_staleness)
    ahead.start(limit=6)
    taken = _train(ahead, range(1, 7))
    ahead.stop()
    for chunk in taken:
        trained_from = chunk.index  # step index + 1 trains from policy version index
        assert trained_from - min(engine.started[chunk.index]) <= max_staleness
        assert trained_from - chunk.min_version <= max_staleness
    if max_staleness == 0:
        assert all(v == [i] for i, v in engine.started.items()), engine.started


def test_nothing_is_generated_at_or_past_the_limit():
    ahead, engine = _ahead(3)
    ahead.start(limit=2)
    _train(ahead, range(1, 3))
    ahead.stop()
    assert sorted(engine.started) == [0, 1]


def test_a_snapshot_accounts_for_every_issued_prompt_exactly_once():
    source = _source()
    ahead, _ = _ahead(2, source=source)
    ahead.start(limit=8)
    trained = [p.index for c in _train(ahead, range(1, 4)) for p in c.prompts]
    snap = ahead.snapshot(source)
    ahead.stop()
    pending = [p["index"] for c in snap["chunks"] for p in c["prompts"]]
    issued = _source().next_batch(snap["cursor"]["offset"])
    assert sorted(trained + pending) == sorted(p.index for p in issued)
    assert len(set(trained + pending)) == len(trained + pending)

    resumed_source = PromptSource(source.rows, None, DataCursor.from_dict(snap["cursor"]))
    resumed, _ = _ahead(2, source=resumed_source, policy_version=3, next_chunk=3,
                        restored=[Chunk.from_dict(c) for c in snap["chunks"]])
    resumed.start(limit=8)
    later = [p.index for c in _train(resumed, range(4, 9)) for p in c.prompts]
    resumed.stop()
    everything = trained + later
    assert sorted(everything) == sorted(p.index for p in _source().next_batch(8 * PROMPTS_PER_STEP))


def test_a_chunk_cut_by_a_weight_push_is_generated_again():
    ahead, engine = _ahead(0, engine_kw={"abort_first_try": {1}})
    ahead.start(limit=3)
    taken = _train(ahead, range(1, 4))
    ahead.stop()
    assert len(engine.started[1]) == 2
    assert all(s.finish_reason == "stop" for c in taken for s in c.samples)


@pytest.mark.parametrize("on_stale", ["regenerate", "drop"])
def test_a_restored_chunk_over_the_bound_is_never_trained(on_stale):
    old = Chunk(5, _source().next_batch(PROMPTS_PER_STEP), samples=[], min_version=1)
    ahead, engine = _ahead(1, policy_version=5, next_chunk=5, restored=[old], on_stale=on_stale)
    ahead.start(limit=6)
    chunk = ahead.take(5, timeout_s=10)
    ahead.stop()
    if on_stale == "drop":
        assert chunk.dropped_stale and chunk.samples == [] and 5 not in engine.started
    else:
        assert engine.started[5] == [5] and chunk.min_version == 5 and chunk.samples


def test_a_failing_rollout_fails_the_trainer_with_its_cause():
    def broken(index: int, prompts: list[Prompt]) -> list[Sample]:
        raise ConnectionError("engine at 127.0.0.1:1 refused the connection")

    ahead = RolloutAhead(_source(), broken, prompts_per_step=2, max_staleness=0, policy_version=0,
                         next_chunk=0)
    ahead.start(limit=2)
    with pytest.raises(RolloutError, match="refused the connection"):
        ahead.take(0, timeout_s=10)
    ahead.stop()


class GatedEngine(Engine):
    """Generation of each chunk blocks until the test opens its gate."""

    def __init__(self, ahead_ref: list) -> None:
        super().__init__(ahead_ref)
        self.gates: dict[int, threading.Event] = {}
        self.running = threading.Event()

    def __call__(self, index: int, prompts: list[Prompt]) -> list[Sample]:
        gate = self.gates.setdefault(index, threading.Event())
        self.running.set()
        gate.wait(10)
        return super().__call__(index, prompts)


def _gated(max_staleness: int) -> tuple[RolloutAhead, GatedEngine]:
    ref: list = []
    engine = GatedEngine(ref)
    ahead = RolloutAhead(_source(), engine, prompts_per_step=PROMPTS_PER_STEP, max_staleness=max_staleness,
                         policy_version=0, next_chunk=0)
    ref.append(ahead)
    return ahead, engine


def test_a_push_waits_for_the_trainers_next_chunk_and_starts_nothing_meanwhile():
    ahead, engine = _gated(max_staleness=1)
    engine.gates[0] = threading.Event()
    engine.gates[0].set()
    ahead.start(limit=3)
    ahead.take(0, timeout_s=10)  # step 1 trains chunk 0; chunk 1 is now being generated
    assert engine.running.wait(5)
    entered = threading.Event()

    def push() -> None:
        with ahead.hold_for_push(next_index=1, timeout_s=10) as waited_s:
            assert waited_s > 0.1  # it waited for chunk 1 instead of cutting it
            entered.set()
            ahead.advance(1)  # chunk 2 is now allowed by the bound, but not during the push
            time.sleep(0.3)
            assert 2 not in engine.started

    pusher = threading.Thread(target=push)
    pusher.start()
    assert not entered.wait(0.3), "the push went ahead while the trainer's next chunk was generating"
    engine.gates.setdefault(1, threading.Event()).set()
    pusher.join(10)
    assert entered.is_set() and engine.started[1] == [0]  # generated once, under version 0
    engine.gates.setdefault(2, threading.Event()).set()
    assert ahead.take(1, timeout_s=10).samples
    assert ahead.take(2, timeout_s=10).samples and engine.started[2] == [1]
    ahead.stop()


def test_a_push_stops_waiting_for_a_chunk_after_its_timeout():
    ahead, engine = _gated(max_staleness=1)
    ahead.start(limit=2)
    assert engine.running.wait(5)  # chunk 0 is generating and nobody opens its gate
    with ahead.hold_for_push(next_index=0, timeout_s=0.2) as waited_s:
        assert 0.2 <= waited_s < 2
    engine.gates[0].set()
    ahead.stop()
