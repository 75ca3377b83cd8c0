"""A test hook (`hooks.on_step_end`) that holds the loop after one step while a file exists.

A test that SIGKILLs a run "after step N" polls metrics.jsonl for step N; the tiny model's
steps take ~0.1 s, so under load the poll can see step N only after step N+1 and its
checkpoint, and the kill lands somewhere else than the test means. With this hook the loop
waits after step N's metrics row is written (on_metrics runs before the hooks) until the test
removes the file, so the kill lands exactly there. The file and the step come from the
environment, which stage jobs inherit; without them (the resumed run) the hook does nothing.
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping

from milepost.core.step_context import StepContext

FILE_ENV, STEP_ENV = "MILEPOST_TEST_HOLD_FILE", "MILEPOST_TEST_HOLD_STEP"
MAX_HOLD_S = 600.0


def hold(metrics: Mapping[str, object], context: StepContext) -> None:
    path = os.environ.get(FILE_ENV)
    if not path or context.step != int(os.environ.get(STEP_ENV, "0")):
        return
    deadline = time.monotonic() + MAX_HOLD_S
    while os.path.exists(path) and time.monotonic() < deadline:
        time.sleep(0.05)
