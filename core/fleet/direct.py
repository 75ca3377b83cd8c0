"""Generation sent to the engines themselves, not through sglang-router: for MoE rollouts.

sglang-router re-serialises /generate bodies and drops fields it does not know, among them
`return_routed_experts` (../shared/FACTS.md), so an MoE rollout's routes never come back
through it. `DirectEngines` takes the router's two jobs for those requests:

- **load balance**: each request goes to the serving engine with the fewest requests this
  client has in flight there (ties: the lowest index), so a chunk's n concurrent requests
  spread over the fleet as the router's round robin would spread them;
- **an engine's death**: a request that got no reply or a 5xx marks its engine as failed
  for `FAILED_COOLDOWN_S` (or until the supervisor installs a successor, whose client is a
  new object) and raises; `direct_client` wraps it in the same `RetryingClient` the fleet's
  router client uses, which sends the whole request again (same body, same seed: same
  tokens), and this picks another engine. No sample is lost or duplicated (retrying.py).

Engines come from `fleet.supervisor.live_clients()` at every request: a restarted engine
serves as soon as the supervisor admits it. Thread-safe: the in-flight counts and failure
marks change under one lock; the HTTP call runs outside it.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from milepost.core.fleet.client import EngineClient, EngineError
from milepost.core.fleet.retrying import RetryingClient, is_retryable

if TYPE_CHECKING:
    from milepost.core.fleet.fleet import Fleet

FAILED_COOLDOWN_S = 5.0


class DirectEngines:
    def __init__(self, live_clients: Callable[[], list[EngineClient]]) -> None:
        self.live_clients = live_clients
        self.base_url = "direct-to-engines"  # what RetryingClient names in its log lines
        self._lock = threading.Lock()
        self._in_flight: dict[int, int] = {}  # id(client) -> requests running there
        self._failed: dict[int, float] = {}  # id(client) -> when its last request failed
        self.num_requests: dict[str, int] = {}  # engine URL -> requests sent there (load balance, tests)

    def _pick(self) -> EngineClient:
        now = time.monotonic()
        with self._lock:
            clients = self.live_clients()
            healthy = [c for c in clients if now - self._failed.get(id(c), -FAILED_COOLDOWN_S) >= FAILED_COOLDOWN_S]
            pool = healthy or clients  # all recently failed: try them again rather than wait idle
            if not pool:
                raise EngineError("POST /generate", None, "no engine is serving (all dead or restarting)")
            client = min(pool, key=lambda c: self._in_flight.get(id(c), 0))
            self._in_flight[id(client)] = self._in_flight.get(id(client), 0) + 1
            self.num_requests[client.base_url] = self.num_requests.get(client.base_url, 0) + 1
            return client

    def generate(self, *args: Any, **kwargs: Any) -> Any:
        """EngineClient.generate on the least busy serving engine; raises what the engine raised."""
        client = self._pick()
        try:
            return client.generate(*args, **kwargs)
        except EngineError as e:
            if is_retryable(e):
                with self._lock:
                    self._failed[id(client)] = time.monotonic()
            raise
        finally:
            with self._lock:
                self._in_flight[id(client)] -= 1

    def in_flight(self) -> dict[int, int]:
        with self._lock:
            return dict(self._in_flight)


def direct_client(fleet: Fleet) -> RetryingClient:
    """The fleet's generation client for MoE rollouts: like `fleet.router_client` (same retry
    window and restart-budget check), but straight to the engines."""
    return RetryingClient(DirectEngines(fleet.supervisor.live_clients),
                          window_s=fleet.cfg.engine_startup_timeout_s + 60, check=fleet.raise_if_failed)
