"""MoE rollouts bypass the router: the direct client's engine choice (real clients, closed ports)."""

from __future__ import annotations

import pytest

from milepost.core.fleet.client import EngineClient, EngineError
from milepost.core.fleet.direct import DirectEngines
from milepost.core.fleet.router import free_port


def _unreachable() -> EngineClient:
    return EngineClient(f"http://127.0.0.1:{free_port()}", timeout_s=2.0)


def test_an_engine_that_gave_no_reply_is_skipped_while_another_serves() -> None:
    first, second = _unreachable(), _unreachable()
    direct = DirectEngines(lambda: [first, second])
    with pytest.raises(EngineError) as failed:
        direct.generate(input_ids=[1, 2], sampling_params={})
    assert failed.value.status is None and failed.value.endpoint.startswith(f"POST {first.base_url}")
    with pytest.raises(EngineError) as again:  # the retry goes to the other engine
        direct.generate(input_ids=[1, 2], sampling_params={})
    assert again.value.endpoint.startswith(f"POST {second.base_url}")
    assert direct.num_requests == {first.base_url: 1, second.base_url: 1}
    assert set(direct.in_flight().values()) == {0}


def test_no_serving_engine_is_a_retryable_error() -> None:
    with pytest.raises(EngineError, match="no engine is serving") as error:
        DirectEngines(lambda: []).generate(input_ids=[1], sampling_params={})
    assert error.value.status is None  # RetryingClient waits for a restarted engine
