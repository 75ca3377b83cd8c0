"""The stage jobs' start-up line (tasks/startup_timer.py): the process's age read from /proc
is its real age, and the parts are timed back to back, in order."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from milepost.tasks.startup_timer import StartupTimer, process_age_s


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc (Linux)")
def test_process_age_is_the_time_since_the_process_started() -> None:
    code = ("import time; time.sleep(1.5); from milepost.tasks.startup_timer import process_age_s; "
            "print(process_age_s())")
    started = time.monotonic()
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    wall = time.monotonic() - started
    age = float(out.stdout)
    assert 1.5 <= age <= wall + 0.1, (age, wall)  # /proc's clock ticks: 10 ms


def test_parts_are_timed_back_to_back_and_named_in_order(monkeypatch) -> None:
    clock = iter([10.0, 12.5, 12.75])
    monkeypatch.setattr(time, "perf_counter", lambda: next(clock))
    monkeypatch.setattr("milepost.tasks.startup_timer.process_age_s", lambda: 3.0)
    timer = StartupTimer("run_steps")
    timer.mark("fleet attached")
    timer.mark("trainer ranks")
    assert timer.line() == ("run_steps start-up: process before this point 3.0 s, fleet attached 2.5 s, "
                            "trainer ranks 0.2 s")


def test_without_proc_the_process_part_is_left_out(monkeypatch) -> None:
    monkeypatch.setattr("milepost.tasks.startup_timer.process_age_s", lambda: None)
    timer = StartupTimer("start_engines")
    timer.mark("ray connected")
    assert timer.line().startswith("start_engines start-up: ray connected ")
    assert process_age_s() is None or process_age_s() >= 0.0
