"""A fleet of built-in engines as Ray actors, the real sglang-router in front, and a
supervisor that keeps the engines alive for the whole stage.

The caller owns Ray (ray.init() before Fleet.start). Generation goes through the router;
control calls (pause, weight updates) go to each engine through `Fleet.clients`, because
the router does not forward them (../shared/FACTS.md).
"""

from __future__ import annotations

import contextlib
import tempfile
import threading
from typing import Any, Iterator, Protocol

import httpx
import ray

from milepost.core.config import RolloutConfig
from milepost.core.engine.actor import EngineActor
from milepost.core.engine.client import EngineClient
from milepost.core.engine.retrying import RetryingClient
from milepost.core.engine.router import Router
from milepost.core.engine.supervisor import FleetError, FleetSupervisor

__all__ = ["EngineActor", "Fleet", "FleetError", "FleetTransport"]


class Fleet:
    """Engines + router + supervisor. One owner starts and stops it.

    How to use it (stage code):

        fleet = Fleet.start(path, cfg.num_engines, cfg, version)   # every engine healthy
        rollout_fn(request, fleet.router_client)   # RetryingClient: survives an engine's death
        transport = FleetTransport(fleet, build_transport(...))  # pass this to the loop
        ...
        fleet.raise_if_failed()   # at stage end: a used-up restart budget fails the stage
        fleet.stop()

    - `fleet.router_client` retries a /generate lost with a dead engine (same body, same
      sampling_seed: same tokens) and raises `FleetError` once the restart budget is spent.
    - `fleet.clients` / `engine_urls` / `actors` are lists whose items the supervisor
      replaces IN PLACE when it restarts an engine: hold the list, not its items.
    - A restarted engine loads `fleet.served`, the weights of the last successful push.
      `FleetTransport` records it; code pushing weights another way does so inside
      `with fleet.weight_push() as clients:` and calls `fleet.record_served(path, version)`
      there on success.
    - `fleet.restart_events()` lists the restarts (engine, pids, reason, timings) for the
      stage record.

    Concurrency: `lock` (re-entrant) guards `served`, the client lists and every weight push;
    the supervisor takes it to install a restarted engine (see FleetSupervisor). `pushing` is
    set while a push runs, so paused engines' slow health checks are not held against them.
    """

    def __init__(self, model_path: str, weight_version: str, cfg: RolloutConfig, host: str,
                 log_dir: str | None = None) -> None:
        self.base_model_path, self.base_weight_version = model_path, weight_version
        self.cfg, self.host = cfg, host
        self.log_dir = log_dir or tempfile.mkdtemp(prefix="milepost-fleet-")
        self.lock = threading.RLock()
        self.served: tuple[str, str] = (model_path, weight_version)
        self.pushing = threading.Event()
        self.actors: list[Any] = []
        self.engine_urls: list[str] = []
        self.clients: list[EngineClient] = []
        self.router: Router | None = None
        self.router_url: str | None = None
        self.router_client: Any = None
        self.supervisor = FleetSupervisor(self, cfg)

    @classmethod
    def start(cls, model_path: str, num_engines: int, cfg: RolloutConfig, weight_version: str = "0",
              host: str = "127.0.0.1", *, load_delay_s: float = 0.0, log_dir: str | None = None) -> "Fleet":
        """Launch the engines, wait until each is healthy, start the router in front.
        `load_delay_s` (tests only) makes every engine's cold start that much slower."""
        fleet = cls(model_path, weight_version, cfg, host, log_dir)
        fleet.supervisor.load_delay_s = load_delay_s
        fleet.clients = [None] * num_engines  # type: ignore[list-item]  # filled by admission
        fleet.engine_urls, fleet.actors = [""] * num_engines, [None] * num_engines
        try:
            fleet.supervisor.launch_all(num_engines)
            fleet.supervisor.wait_all_serving(cfg.engine_startup_timeout_s + 60)
            with fleet.lock:  # an engine admitted from now on registers with this router itself
                fleet.router = Router.start(list(fleet.engine_urls), policy=cfg.router_policy, host=host)
            fleet.router_url = fleet.router.url
            # Retry for as long as replacing a dead engine may take: a fleet whose every
            # engine died serves again only once a successor is routable.
            fleet.router_client = RetryingClient(EngineClient(fleet.router_url, cfg.request_timeout_s),
                                                 window_s=cfg.engine_startup_timeout_s + 60,
                                                 check=fleet.raise_if_failed)
        except BaseException:
            fleet.stop()
            raise
        return fleet

    def _install(self, index: int, client: EngineClient, url: str, actor: Any) -> None:
        """Called by the supervisor, holding `lock`: engine `index` is now this one."""
        old = self.clients[index]
        self.clients[index], self.engine_urls[index], self.actors[index] = client, url, actor
        if old is not None and old is not client:
            old.close()

    @contextlib.contextmanager
    def weight_push(self) -> Iterator[list[EngineClient]]:
        """Hold `lock` for a weight push; yields the engines serving now (one being restarted
        is left out: it loads `served` when admitted, after this push has recorded it)."""
        with self.lock:
            self.pushing.set()
            try:
                yield self.supervisor.live_clients()
            finally:
                self.pushing.clear()

    def record_served(self, path: str, version: str) -> None:
        """The fleet now serves `path` as `version`: what a restarted engine must load."""
        with self.lock:
            self.served = (path, str(version))

    def raise_if_failed(self) -> None:
        self.supervisor.raise_if_failed()

    def restart_events(self) -> list[dict[str, Any]]:
        return list(self.supervisor.events)

    def pids(self) -> list[int]:
        return [s.pid for s in self.supervisor.slots]

    def health_check(self) -> dict[str, bool]:
        """GET /health of every engine and of the router, by URL."""
        status = {c.base_url: c.health() for c in self.clients if c is not None}
        if self.router_url:
            try:
                status[self.router_url] = httpx.get(f"{self.router_url}/health", timeout=5.0).status_code == 200
            except httpx.HTTPError:
                status[self.router_url] = False
        return status

    def stop(self) -> None:
        self.supervisor.stop()
        if self.router is not None:
            self.router.stop()
        for c in self.clients:
            if c is not None:
                c.close()
        if ray.is_initialized():  # else the actors went with Ray
            for s in self.supervisor.slots:
                ray.kill(s.actor, no_restart=True)


class WeightTransport(Protocol):
    """What `milepost.core.weight_sync` transports provide (not imported: the fleet must not
    depend on which transports exist). `backend` is passed only when given."""

    name: str

    def push(self, clients: list[EngineClient], export_dir: str, version: str,
             **backend: Any) -> dict[str, float]: ...


class FleetTransport:
    """A weight transport that knows the fleet: it pushes to the engines serving now (an
    engine being restarted is skipped: it loads the recorded weights when admitted), holds
    `fleet.lock` for the whole push, and records what the fleet serves on success.

    If a push fails because an engine died during it, the dead engine is marked and the push
    is retried once on the engines left; any other failure is raised as the inner one.

    A restarted engine reloads `export_dir` from disk, whatever the transport: the loop must
    keep exporting HF weights there before each push (it does now), or admission fails with
    "could not load the served weights".
    """

    def __init__(self, fleet: Fleet, inner: WeightTransport) -> None:
        self.fleet, self.inner, self.name = fleet, inner, inner.name

    def push(self, clients: list[EngineClient], export_dir: str, version: str,
             backend: Any = None) -> dict[str, float]:
        del clients  # the fleet's live engines now, not a list captured earlier
        extra = {} if backend is None else {"backend": backend}
        for attempt in (1, 2):
            self.fleet.raise_if_failed()
            with self.fleet.weight_push() as live:
                try:
                    metrics = self.inner.push(live, export_dir, version, **extra)
                except Exception:
                    if attempt == 2 or not self.fleet.supervisor.probe():
                        raise
                    continue
                self.fleet.record_served(export_dir, version)
                return metrics
        raise AssertionError("unreachable")
