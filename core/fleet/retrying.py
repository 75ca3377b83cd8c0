"""An EngineClient for the router whose /generate survives an engine's death.

sglang-router retries connect errors, resets and 5xx on another worker by itself (a
request in flight on a SIGKILLed engine comes back 200 from a peer, measured), but it gives
up after its own few retries (all of them can land on a worker it has not yet marked
dead), answers 503 while no worker is healthy, and a request can time out. This wrapper
retries the WHOLE request then, with the same body.

No sample is lost or duplicated: a reply is taken whole or not at all, and a retried
request carries the same `sampling_seed`, so it yields the same tokens as the lost one
would have. (The built-in engine seeds each sequence from it; SGLang does too with
deterministic sampling.)
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from milepost.core.fleet.client import EngineError, GenerationClient

log = logging.getLogger(__name__)


def is_retryable(error: EngineError) -> bool:
    """No reply (connection refused/reset, timeout) or a server-side 5xx; 4xx is the caller's."""
    return error.status is None or error.status >= 500


def _aborted(reply: Any) -> bool:
    outputs = reply if isinstance(reply, list) else [reply]
    for out in outputs:
        reason = (out.get("meta_info") or {}).get("finish_reason") if isinstance(out, dict) else None
        if isinstance(reason, dict) and reason.get("type") == "abort":
            return True
    return False


class RetryingClient:
    """Wraps an EngineClient; `generate` retries, every other attribute is the wrapped one's.

    Retries go on for up to `window_s` (the fleet sets it to an engine's restart time, so a
    fleet whose only engine died waits for its successor), backoff doubling from
    `backoff_s` to `max_backoff_s`. `check` runs before every attempt and may raise: the
    fleet raises its FleetError there, so a rollout stops at once when the restart budget is
    spent instead of waiting out the window. `retry_aborted`: a reply with an aborted output
    (engine shutting down, request aborted under it) is retried whole; turn it off where the
    caller handles aborts itself (partial rollouts across a weight update).

    Thread-safe: the wrapped client is, and `num_retries` is only a counter for metrics.
    """

    def __init__(self, inner: GenerationClient, window_s: float = 60.0, backoff_s: float = 0.25,
                 max_backoff_s: float = 2.0, check: Callable[[], None] | None = None,
                 retry_aborted: bool = True) -> None:
        self.inner, self.window_s, self.check = inner, window_s, check
        self.backoff_s, self.max_backoff_s, self.retry_aborted = backoff_s, max_backoff_s, retry_aborted
        self.num_retries = 0

    def generate(self, *args: Any, **kwargs: Any) -> Any:
        """EngineClient.generate, retried on engine loss; raises the last error after the window."""
        deadline, delay, attempt = time.monotonic() + self.window_s, self.backoff_s, 0
        while True:
            attempt += 1
            if self.check is not None:
                self.check()
            try:
                reply = self.inner.generate(*args, **kwargs)
            except EngineError as e:
                if not is_retryable(e) or time.monotonic() + delay >= deadline:
                    raise
                problem = str(e)
            else:
                if not (self.retry_aborted and _aborted(reply)) or time.monotonic() + delay >= deadline:
                    return reply
                problem = "an output was aborted"
            log.warning("generate attempt %d via %s failed (%s); retrying the whole request in %.2fs",
                        attempt, self.inner.base_url, problem, delay)
            self.num_retries += 1
            time.sleep(delay)
            delay = min(delay * 2, self.max_backoff_s)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)
