"""The W&B sink: one offline run per campaign, each committed (step, tag) written once across
reopenings and a SIGKILLed writer, read back with W&B's own reader (`wandb leet inspect`)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from datetime import datetime, timedelta
from pathlib import Path

import pytest

from milepost.core.metrics.sinks import SinkSet
from milepost.core.metrics.wandb_sink import STEP_KEY, WandbSink, read_history
from milepost.core.recipe_io import RecipeError, recipe_from_dict

TAGS = ("rollout/reward_mean", "loss/kl")


def _rows(first: int, last: int) -> list[dict]:
    return [{"step": s, "rollout/reward_mean": s / 10, "loss/kl": 0.01 * s} for s in range(first, last + 1)]


def _sink(root: Path) -> WandbSink:
    return WandbSink(str(root), "tiny-arith", run_id="c0ffee", run_name="c", config={"train.lr": "5e-05"})


def _steps_per_tag(sink: WandbSink) -> dict[str, list[int]]:
    """Every (step, tag) in every segment of the run, as W&B's reader gives them: a step
    written twice shows twice."""
    out: dict[str, list[int]] = {}
    for path in sink.segments():
        for item in read_history(path):
            for tag in item:
                if not tag.startswith("_") and tag != STEP_KEY:
                    out.setdefault(tag, []).append(int(item[STEP_KEY]))
    return {tag: sorted(steps) for tag, steps in out.items()}


def test_wandb_sink_reopened_writes_each_step_once_into_one_run(tmp_path: Path) -> None:
    first = SinkSet([_sink(tmp_path)])
    assert first.publish(_rows(1, 3)) == {"wandb": 6}
    first.close()
    sink = _sink(tmp_path)
    second = SinkSet([sink])  # a restarted stage: held read back from the run's files
    # The base policy's eval at step 0 comes after step 3 was written: kept (steps are a metric).
    assert second.publish([{"step": 0, "eval/accuracy": 0.25}] + _rows(1, 5)) == {"wandb": 5}
    second.close()
    assert len(sink.segments()) == 2 and all(p.name == "run-c0ffee.wandb" for p in sink.segments())
    assert _steps_per_tag(sink) == {**{tag: [1, 2, 3, 4, 5] for tag in TAGS}, "eval/accuracy": [0]}
    values = {int(item[STEP_KEY]): item for path in sink.segments() for item in read_history(path)}
    assert values[4]["rollout/reward_mean"] == pytest.approx(0.4)
    assert SinkSet([_sink(tmp_path)]).publish(_rows(1, 5)) == {"wandb": 0}  # from the cache, same answer


def test_a_segment_opened_within_the_same_second_as_another_is_read_back(tmp_path: Path) -> None:
    """W&B names a second segment opened within the same second `offline-run-<second>-<id>-1`;
    its steps count as held (a SIGKILLed stage retried at once made one; CI saw it)."""
    first = SinkSet([_sink(tmp_path)])
    first.publish(_rows(1, 2))
    first.close()
    (segment,) = _sink(tmp_path).segments()
    # a real segment under W&B's same-second name, an hour back, so the next segment is later
    opened = datetime.strptime(segment.parent.name.split("-")[2], "%Y%m%d_%H%M%S") - timedelta(hours=1)
    renamed = segment.parent.with_name(f"offline-run-{opened:%Y%m%d_%H%M%S}-c0ffee-1")
    segment.parent.rename(renamed)
    second = SinkSet([_sink(tmp_path)])
    assert second.publish(_rows(1, 3)) == {"wandb": 2}  # steps 1-2 held in the "-1" folder
    second.close()
    sink = _sink(tmp_path)
    assert len(sink.segments()) == 2 and sink.segments()[0].parent == renamed  # oldest first
    assert _steps_per_tag(sink) == {tag: [1, 2, 3] for tag in TAGS}


def test_segments_are_ordered_by_second_then_by_w_and_bs_suffix(tmp_path: Path) -> None:
    names = ["offline-run-20261205_100625-c0ffee-2", "offline-run-20261205_100625-c0ffee",
             "offline-run-20261205_100624-c0ffee-1", "offline-run-20261205_100625-c0ffee-10",
             "offline-run-20261205_100625-c0ffee-1", "offline-run-20261205_100625-beef"]
    for name in names:
        (tmp_path / "wandb" / name).mkdir(parents=True)
        (tmp_path / "wandb" / name / f"run-{name.split('-')[3]}.wandb").touch()
    assert [p.parent.name for p in _sink(tmp_path).segments()] == [
        "offline-run-20261205_100624-c0ffee-1", "offline-run-20261205_100625-c0ffee",
        "offline-run-20261205_100625-c0ffee-1", "offline-run-20261205_100625-c0ffee-2",
        "offline-run-20261205_100625-c0ffee-10"]


def test_a_sigkilled_writer_loses_nothing_and_repeats_nothing(tmp_path: Path) -> None:
    # A stage process that published steps 1-3 and was SIGKILLed before closing its run.
    script = textwrap.dedent(f"""
        import os, signal
        from milepost.core.metrics.sinks import SinkSet
        from milepost.core.metrics.wandb_sink import WandbSink
        sinks = SinkSet([WandbSink({str(tmp_path)!r}, "tiny-arith", run_id="c0ffee", run_name="c", config={{}})])
        sinks.publish([{{"step": s, "rollout/reward_mean": s / 10, "loss/kl": 0.01 * s}} for s in (1, 2, 3)])
        os.kill(os.getpid(), signal.SIGKILL)
    """)
    # A stage job is a fresh process with its own W&B service (this one's, named in WANDB_SERVICE
    # after the test above, would still hold the killed run open).
    env = {k: v for k, v in os.environ.items() if k != "WANDB_SERVICE"}
    killed = subprocess.run([sys.executable, "-c", script], timeout=120, env=env)
    assert killed.returncode == -9
    sink = _sink(tmp_path)
    resumed = SinkSet([sink])
    resumed.publish(_rows(1, 4))
    resumed.close()
    assert _steps_per_tag(sink) == {tag: [1, 2, 3, 4] for tag in TAGS}


def test_wandb_without_its_package_names_the_extra(monkeypatch) -> None:
    from milepost.core import config

    monkeypatch.setitem(config.SINK_EXTRAS, "wandb", ("milepost_no_such_module", "wandb"))
    with pytest.raises(RecipeError) as err:
        recipe_from_dict({"metrics": {"sinks": ["wandb"]}})
    assert "pip install 'milepost[wandb]'" in str(err.value) and "metrics.sinks" in str(err.value)
