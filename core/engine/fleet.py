"""A fleet of built-in engines as Ray actors, with the real sglang-router in front.

The caller owns Ray (ray.init() before Fleet.start). Generation goes through the router;
control calls (pause, weight updates) go to each engine through `Fleet.clients`, because
the router does not forward them (../shared/FACTS.md).
"""

from __future__ import annotations

import threading
import time

import httpx
import ray

from milepost.core.config import RolloutConfig
from milepost.core.engine.client import EngineClient
from milepost.core.engine.router import Router, free_port


class FleetError(RuntimeError):
    pass


@ray.remote(num_cpus=0.5)
class EngineActor:
    """Runs `serve` in a daemon thread of the actor process; the actor's death ends it.
    Methods are called one at a time by the fleet (Ray's default actor concurrency)."""

    def __init__(self) -> None:
        self.url: str | None = None

    def start(self, model_path: str, weight_version: str, max_batch_size: int,
              host: str = "127.0.0.1", startup_timeout_s: float = 180.0) -> str:
        """Start the server; returns its URL once GET /health is 200 (model loaded)."""
        from milepost.core.engine.server import serve  # heavy imports only inside the actor

        port = free_port(host)
        thread = threading.Thread(target=serve, args=(model_path, host, port, weight_version, max_batch_size),
                                  daemon=True, name="engine-http")
        thread.start()
        url = f"http://{host}:{port}"
        deadline = time.monotonic() + startup_timeout_s  # grace period: cold start is slow
        while time.monotonic() < deadline:
            if not thread.is_alive():
                raise FleetError(f"engine server at {url} exited during start-up")
            try:
                if httpx.get(f"{url}/health", timeout=2.0).status_code == 200:
                    self.url = url
                    return url
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise FleetError(f"engine at {url} not healthy after {startup_timeout_s:.0f}s")

    def get_url(self) -> str | None:
        return self.url


class Fleet:
    """Engines + router. Not thread-safe: one owner starts, checks and stops it."""

    def __init__(self, actors: list, engine_urls: list[str], router: Router, timeout_s: float) -> None:
        self.actors, self.engine_urls, self.router = actors, engine_urls, router
        self.router_url = router.url
        self.clients = [EngineClient(u, timeout_s) for u in engine_urls]

    @classmethod
    def start(cls, model_path: str, num_engines: int, cfg: RolloutConfig, weight_version: str = "0",
              host: str = "127.0.0.1") -> "Fleet":
        actors = [EngineActor.remote() for _ in range(num_engines)]
        refs = [a.start.remote(model_path, weight_version, cfg.max_batch_size, host,
                               cfg.engine_startup_timeout_s) for a in actors]
        try:
            # the actor enforces the grace period; the margin covers actor process start-up
            urls = ray.get(refs, timeout=cfg.engine_startup_timeout_s + 60)
            router = Router.start(urls, policy=cfg.router_policy, host=host)
        except BaseException:
            for a in actors:
                ray.kill(a)
            raise
        return cls(actors, urls, router, cfg.request_timeout_s)

    def health_check(self) -> dict[str, bool]:
        """GET /health of every engine and of the router, by URL."""
        status = {c.base_url: c.health() for c in self.clients}
        try:
            status[self.router_url] = httpx.get(f"{self.router_url}/health", timeout=5.0).status_code == 200
        except httpx.HTTPError:
            status[self.router_url] = False
        return status

    def stop(self) -> None:
        self.router.stop()
        for c in self.clients:
            c.close()
        for a in self.actors:
            ray.kill(a)
