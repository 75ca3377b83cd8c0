"""Checks that hold for every test of the suite."""

from __future__ import annotations

import os

import pytest

# Variables that, left behind by one test, change how every later test starts or joins Ray
# (a stale token path counts as the user's own setting and the next head refuses its token).
# Not RAY_AUTH_MODE: Ray's own `ray.init()` of a local cluster sets it to `token` for the
# process (with ~/.ray's token), which every later start or join honours.
_PROCESS_WIDE = ("RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH", "RAY_ADDRESS")


@pytest.fixture(autouse=True)
def _no_ray_settings_leak_out_of_a_test():
    before = {name: os.environ.get(name) for name in _PROCESS_WIDE}
    yield
    after = {name: os.environ.get(name) for name in _PROCESS_WIDE}
    leaked = {name: value for name, value in after.items() if value != before[name]}
    if leaked:
        for name, value in before.items():  # so that the tests after this one run as they should
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        pytest.fail(f"this test (or the code it ran) left process-wide Ray settings changed: {leaked}")


@pytest.fixture(scope="session")
def tiny_model_cache(tmp_path_factory):
    """One MILEPOST_CACHE for the whole session. Tests that run tiny-arith with the recipe's own
    model settings (warm start 600 steps, ≈3 min on 2 cores) find the model built by the first
    of them instead of building it again per module."""
    return tmp_path_factory.mktemp("model-cache")
