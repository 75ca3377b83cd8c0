"""Options and session fixtures of the fault-injection suite.

    python -m pytest tests/faults                         # the bounded CI set
    python -m pytest tests/faults --soak --soak-runs 60   # the whole matrix; writes RESULTS.md

`--soak-dir` keeps every campaign, log and the reference runs (default: a pytest temp dir);
`--soak-workers 2` runs two campaigns at once; `--soak-deadline HH:MM` starts no run after
that local time; `--soak-steps` sets the steps of each run's one block.
`MILEPOST_FAULTS_CACHE` points every run at one model cache (default: under the run dir).
"""

from __future__ import annotations

import os
import threading
from pathlib import Path

import fault_campaign as cp
import fault_kinds as faults
import pytest


def pytest_addoption(parser):
    group = parser.getgroup("faults", "fault-injection suite (tests/faults)")
    group.addoption("--soak", action="store_true", default=False, help="run the whole fault matrix")
    group.addoption("--soak-runs", type=int, default=60, help="seeded runs in all (default 60)")
    group.addoption("--soak-workers", type=int, default=1, help="campaigns run at once (default 1)")
    group.addoption("--soak-dir", default=None, help="where campaigns, logs and references go")
    group.addoption("--soak-deadline", default=None, help="HH:MM: start no run after this local time")
    group.addoption("--soak-steps", type=int, default=2, help="steps of each run's block (default 2)")
    group.addoption("--soak-resume", action="store_true", default=False,
                    help="keep the runs tests/faults/results.csv holds, run only the others")
    group.addoption("--soak-kinds", default=None, help="comma-separated fault kinds (default: all)")
    group.addoption("--soak-seed", type=int, default=1, help="first seed of each cell (default 1)")


@pytest.fixture(scope="session")
def fault_shape(request) -> cp.Shape:
    return cp.Shape(steps_per_block=cp.option(request.config, "--soak-steps", 2))


@pytest.fixture(scope="session")
def fault_root(request, tmp_path_factory) -> Path:
    chosen = cp.option(request.config, "--soak-dir")
    root = Path(chosen) if chosen else tmp_path_factory.mktemp("faults")
    root.mkdir(parents=True, exist_ok=True)
    return root.resolve()


@pytest.fixture(scope="session")
def fault_cache(fault_root, fault_shape, tiny_model_cache) -> Path:
    """One model cache for every run of the session: the tiny model is built once (the suite's
    shared cache unless MILEPOST_FAULTS_CACHE names one)."""
    cache = Path(os.environ.get("MILEPOST_FAULTS_CACHE") or tiny_model_cache)
    cp.build_model(cache, fault_shape.overrides())
    return cache


@pytest.fixture(scope="session")
def references(fault_root, fault_cache, fault_shape):
    """reference(mode, executor) -> final model_sha256 of the uninterrupted run, computed once
    per session (and kept in the run dir: a later session with the same dir reuses it)."""
    shas: dict[tuple[str, str], str] = {}
    locks = {(m, e): threading.Lock() for m in cp.MODES for e in cp.EXECUTORS}

    def get(mode: str, executor: str) -> str:
        with locks[mode, executor]:  # two references may run at once, one of each never twice
            if (mode, executor) not in shas:
                shas[mode, executor] = faults.reference(fault_root, fault_cache, fault_shape, mode, executor)
            return shas[mode, executor]
    return get
