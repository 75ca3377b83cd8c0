"""The progress line of `milepost run`: the running stage with its rate and ETA, read from the
store; nothing written when stderr is not a terminal."""

from __future__ import annotations

import io

import pytest

from milepost.core.records import Stage
from milepost.core.store import CampaignStore
from milepost.tasks.progress import ProgressLine, current_line, stage_line, steps_line


@pytest.fixture
def store(tmp_path) -> CampaignStore:
    return CampaignStore(str(tmp_path / "c"))


def test_run_steps_shows_steps_per_second_of_this_try_and_the_eta(store) -> None:
    # block 1 of 8 steps (9-16); this try resumed from committed step 10 at t=1000 and is at 13.
    store.write_stage_record(1, "run_steps", {"state": "running", "started_at": 990.0})
    store.write_json("blocks/000001/train_starts.json", [{"at": 500.0, "from_step": 8},
                                                         {"at": 1000.0, "from_step": 10}])
    store.write_metrics(1, [{"step": s, "rollout/reward_mean": s / 100} for s in range(9, 14)])
    line = current_line(store, 1, 8, now=1030.0)
    # 3 steps in 30 s: 0.10 steps/s; 3 steps left: 30 s
    assert line == "block 1 run_steps: step 5/8 · 0.10 steps/s · ETA 30 s · reward 0.130"


def test_a_stage_without_steps_is_timed_against_the_same_stage_of_the_block_before(store) -> None:
    store.write_stage_record(0, "start_engines", {"state": "done", "started_at": 0.0, "finished_at": 65.0})
    store.write_stage_record(1, "start_ray", {"state": "done", "started_at": 900.0, "finished_at": 950.0})
    store.write_stage_record(1, "start_engines", {"state": "running", "started_at": 1000.0})
    assert current_line(store, 1, 8, now=1042.0) == (
        "block 1 start_engines (engine start-up, warm-start, base eval): 42 s · last time 1 min 5 s · ETA 23 s")
    assert stage_line(0, Stage.PUBLISH, 12.0, None) == "block 0 publish (export): 12 s"
    assert stage_line(2, Stage.PUBLISH, 12.0, 5.0).endswith("longer than last time")


def test_nothing_running_and_no_step_yet() -> None:
    assert steps_line(0, 0, 4, None, None) == "block 0 run_steps: step 0/4"


def test_the_line_is_quiet_off_a_terminal_and_rewrites_itself_on_one() -> None:
    off = io.StringIO()
    ProgressLine(off).show("block 0 run_steps: step 1/4")
    assert off.getvalue() == ""

    class Tty(io.StringIO):
        def isatty(self) -> bool:
            return True

    tty = Tty()
    line = ProgressLine(tty)
    line.show("block 0 run_steps: step 1/4")
    line.show("step 2")
    line.clear()
    assert tty.getvalue() == ("\rblock 0 run_steps: step 1/4" + "\rstep 2".ljust(len("block 0 run_steps: step 1/4") + 1)
                              + "\r" + " " * 6 + "\r")
