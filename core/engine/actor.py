"""One built-in engine as a Ray actor: the HTTP server runs in a daemon thread of the actor
process, so the process's death (SIGKILL, OOM) is the engine's death.

`launch` returns as soon as the server thread is started; the engine answers 503 (or not
at all) until its model is loaded. Waiting for it is the fleet supervisor's job, so one
start-up timeout, and only that, applies to a warming engine.
"""

from __future__ import annotations

import os
import threading
import time
from typing import Any

import ray

from milepost.core.engine.router import Router, free_port


def node_ip() -> str:
    """The IP literal Ray knows this node by: what other nodes reach it at."""
    return ray.util.get_node_ip_address()


@ray.remote(num_cpus=0.5, max_restarts=0)
class EngineActor:
    """Methods run one at a time (Ray's default); `launch` is called once per actor.

    The process's stdout and stderr (Python and C level) go to `log_path`, which the
    supervisor quotes when it reports a dead engine: Ray's own worker logs are per node and
    named by worker id, so nobody would find them in a stage error.
    """

    def __init__(self, log_path: str) -> None:
        fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.close(fd)
        self.log_path = log_path
        self.thread: threading.Thread | None = None
        self.sched: Any = None  # the server's Scheduler, once its model load has begun

    def launch(self, model_path: str, weight_version: str, max_batch_size: int, host: str | None = "127.0.0.1",
               load_delay_s: float = 0.0, admin_key_path: str | None = None) -> tuple[str, int]:
        """Start the server thread; returns (url, pid) at once, before the model is loaded.
        `host` None: this node's IP literal (engines of a multi-node cluster must be reachable),
        never 0.0.0.0. `admin_key_path`: a file with the admin key (read here: the key itself
        never travels through Ray nor a command line).

        `load_delay_s` (tests only) delays the model load while the server already answers
        503, which is how a slow cold start looks to a health checker.
        """
        from milepost.core.engine import server  # heavy imports only inside the actor
        from milepost.core.engine.http_guard import read_key_file

        load = server.load_engine

        def load_and_keep(sched: Any) -> None:
            # `serve` keeps its Scheduler to itself; catching it here lets `status` report a
            # failed model load (the server would answer 503 "loading" forever).
            self.sched = sched
            time.sleep(load_delay_s)
            load(sched)

        server.load_engine = load_and_keep  # this process runs exactly one engine
        host = host or node_ip()
        port = free_port(host)
        print(f"engine pid {os.getpid()} serving {model_path} (version {weight_version}) on {host}:{port}",
              flush=True)
        admin_key = read_key_file(admin_key_path) if admin_key_path else None
        self.thread = threading.Thread(target=server.serve, daemon=True, name="engine-http",
                                       args=(model_path, host, port, weight_version, max_batch_size),
                                       kwargs={"admin_api_key": admin_key})
        self.thread.start()
        return f"http://{host}:{port}", os.getpid()

    def status(self) -> dict[str, Any]:
        """{"pid", "server_alive", "load_error"}: the server thread can die (port taken) or its
        model load fail while the process lives on."""
        return {"pid": os.getpid(), "server_alive": bool(self.thread and self.thread.is_alive()),
                "load_error": getattr(self.sched, "load_error", None)}

    def pid(self) -> int:
        return os.getpid()


@ray.remote(num_cpus=0, max_restarts=0)
class RouterActor:
    """The sglang-router process, owned by a (detached) actor so that it outlives the stage
    that started it and dies with the block's Ray cluster: the router subprocess is SIGKILLed
    when this actor's process dies (PR_SET_PDEATHSIG, see router.py)."""

    def __init__(self, log_path: str) -> None:
        self.log_path = log_path
        self.router: Router | None = None

    def start(self, worker_urls: list[str], policy: str, host: str | None) -> dict:
        """Launch the router in front of `worker_urls`; {"url", "pid", "actor_pid", "log_path"}."""
        self.router = Router.start(worker_urls, policy=policy, host=host or node_ip(), log_path=self.log_path)
        return {"url": self.router.url, "pid": self.router.proc.pid, "actor_pid": os.getpid(),
                "log_path": self.log_path}

    def stop(self) -> None:
        if self.router is not None:
            self.router.stop()
