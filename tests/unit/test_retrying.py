"""RetryingClient: which failures are retried, and that a retry resends the same request."""

from __future__ import annotations

from typing import Any

import pytest

from milepost.core.fleet.client import EngineError
from milepost.core.fleet.retrying import RetryingClient

OK = [{"output_ids": [1, 2], "meta_info": {"finish_reason": {"type": "length", "length": 2}}}]
ABORTED = [{"output_ids": [1], "meta_info": {"finish_reason": {"type": "abort", "message": "engine died"}}}]


class FakeEngine:
    """Plays back `script`: an exception is raised, anything else returned; records calls."""

    base_url = "http://fake"

    def __init__(self, *script: Any) -> None:
        self.script, self.calls = list(script), []

    def generate(self, *args: Any, **kwargs: Any) -> Any:
        self.calls.append((args, kwargs))
        step = self.script.pop(0)
        if isinstance(step, Exception):
            raise step
        return step

    def model_info(self) -> dict:
        return {"weight_version": "3"}


def _client(engine: FakeEngine, **kwargs: Any) -> RetryingClient:
    return RetryingClient(engine, backoff_s=0.0, **kwargs)  # type: ignore[arg-type]


def test_lost_requests_are_resent_unchanged() -> None:
    engine = FakeEngine(EngineError("POST /generate", None, "ConnectError"),
                        EngineError("POST /generate", 503, "no_available_workers"), ABORTED, OK)
    client = _client(engine)
    body = {"input_ids": [[3, 4]], "sampling_params": {"n": 2, "sampling_seed": 7}}
    assert client.generate(**body) == OK
    assert client.num_retries == 3
    assert all(call == ((), body) for call in engine.calls)  # same body, same seed, every time


def test_client_errors_are_not_retried() -> None:
    engine = FakeEngine(EngineError("POST /generate", 400, "bad temperature"), OK)
    with pytest.raises(EngineError) as err:
        _client(engine).generate(input_ids=[3])
    assert err.value.status == 400 and len(engine.calls) == 1


def test_aborts_pass_through_when_the_caller_handles_them() -> None:
    assert _client(FakeEngine(ABORTED), retry_aborted=False).generate(input_ids=[3]) == ABORTED


def test_window_bounds_the_retries() -> None:
    lost = EngineError("POST /generate", None, "ReadError")
    engine = FakeEngine(*[lost] * 50)
    with pytest.raises(EngineError):
        RetryingClient(engine, window_s=0.05, backoff_s=0.01).generate(input_ids=[3])  # type: ignore[arg-type]
    assert 1 < len(engine.calls) < 50


def test_check_stops_retrying() -> None:
    class Broken(RuntimeError):
        pass

    calls = []

    def check() -> None:
        calls.append(1)
        if len(calls) > 1:
            raise Broken("restart budget used up")

    engine = FakeEngine(EngineError("POST /generate", 502, "bad gateway"), OK)
    with pytest.raises(Broken):
        _client(engine, check=check).generate(input_ids=[3])
    assert len(engine.calls) == 1


def test_other_calls_reach_the_wrapped_client() -> None:
    assert _client(FakeEngine()).model_info() == {"weight_version": "3"}
