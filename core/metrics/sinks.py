"""Metric sinks: where a campaign's step metrics go besides blocks/<n>/metrics.jsonl.

Exactly once. A sink is fed committed rows only: a train step's row once the checkpoint that
holds it is committed (a resumed run never trains that step again, so its values are final),
a block's eval once it is measured. Every sink says which (step, tag) pairs it already holds,
read back from its own storage when it is opened, and `SinkSet.publish` writes only the
missing ones. So a restarted, retried or requeued stage writes what the killed one had not:
a step cut mid-write gets its missing tags, and no (step, tag) is written twice. Steps are
never reused: after a regression-gate rollback the next block numbers its steps after the
rejected one's (tasks/progression.py), so a held pair is always the same value.

A sink that fails (a tracking server down for an hour of a multi-week campaign) is logged and
left behind, not fatal: it is read back again at the next publish and catches up then.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Protocol

log = logging.getLogger(__name__)

Held = dict[int, set[str]]


class MetricSink(Protocol):
    name: str

    def held(self) -> Held:
        """The tags it already stores, per step, read from its own storage."""

    def write(self, step: int, scalars: Mapping[str, float]) -> None:
        """Queue one step's scalars (written for good by `flush`)."""

    def flush(self) -> None:
        """Make everything queued durable (a kill after it loses nothing)."""

    def close(self) -> None: ...


def scalars(row: Mapping[str, Any]) -> dict[str, float]:
    """A metrics row's numbers, by tag: `step` and non-numbers (prompt index lists) left out."""
    return {k: float(v) for k, v in row.items()
            if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool)}


def missing(rows: Iterable[Mapping[str, Any]], held: Held) -> list[tuple[int, dict[str, float]]]:
    """What of `rows` a sink holding `held` lacks, by step in ascending order; NaN is kept
    (a diverged step is worth seeing), only pairs already held are dropped."""
    out: dict[int, dict[str, float]] = {}
    for row in rows:
        step = int(row["step"])
        have = held.get(step, set())
        values = {k: v for k, v in scalars(row).items() if k not in have}
        if values:
            out.setdefault(step, {}).update(values)
    return sorted(out.items())


class SinkSet:
    """The campaign's sinks, each with what it holds (read once, then kept up to date)."""

    def __init__(self, sinks: list[MetricSink]) -> None:
        self.sinks = sinks
        self._held: dict[str, Held | None] = {s.name: None for s in sinks}

    def publish(self, rows: Sequence[Mapping[str, Any]]) -> dict[str, int]:
        """Write the (step, tag) pairs of `rows` each sink lacks; returns pairs written per sink."""
        written = {}
        for sink in self.sinks:
            try:
                written[sink.name] = self._publish_one(sink, rows)
            except Exception as e:  # noqa: BLE001 - see the module docstring: caught up later
                self._held[sink.name] = None
                log.warning("metrics sink %s failed (%s: %s); it is read back and caught up at the next "
                            "checkpoint", sink.name, type(e).__name__, e)
                written[sink.name] = 0
        return written

    def _publish_one(self, sink: MetricSink, rows: Sequence[Mapping[str, Any]]) -> int:
        held = self._held[sink.name]
        if held is None:
            held = sink.held()
        todo = missing(rows, held)
        for step, values in todo:
            sink.write(step, values)
        if todo:
            sink.flush()
        for step, values in todo:  # only once durable: a failed flush leaves them to be retried
            held.setdefault(step, set()).update(values)
        self._held[sink.name] = held
        return sum(len(v) for _, v in todo)

    def close(self) -> None:
        for sink in self.sinks:
            try:
                sink.close()
            except Exception as e:  # noqa: BLE001 - closing must not hide the stage's own outcome
                log.warning("metrics sink %s did not close cleanly: %s", sink.name, e)

