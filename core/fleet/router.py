"""The real sglang-router, run as a subprocess in front of the engines.

Measured constraints (../shared/FACTS.md): `--host` must be an IP literal, both hosts
default to 0.0.0.0, worker registration is asynchronous (poll GET /workers), dead workers
are only marked, never removed (DELETE /workers/{id}).

Failure flags (`FAILURE_FLAGS`): the router retries connect errors, resets and 5xx on
another worker by itself (a request in flight on a SIGKILLed engine comes back 200 from
the peer, measured). Its own health check runs every 1 s and marks a worker dead after 2
misses, so requests stop going to a dead engine before the fleet supervisor removes it;
the circuit breaker re-admits a worker after 5 s instead of 60 s. A restarted engine gets
a new URL and a fresh breaker, so it is routable as soon as it is listed.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
import time
from urllib.parse import urlsplit, urlunsplit

import httpx


class RouterError(RuntimeError):
    pass


FAILURE_FLAGS = ["--health-check-interval-secs", "1", "--health-failure-threshold", "2",
                 "--health-check-timeout-secs", "5", "--cb-timeout-duration-secs", "5"]


def _die_with_parent() -> None:
    """Runs in the router child before exec: SIGKILL it when its parent dies, so a driver
    killed with SIGKILL (no finally, no atexit) never leaves its router behind (Linux only)."""
    import ctypes
    import signal
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # 1 = PR_SET_PDEATHSIG
    except OSError:
        pass  # not Linux: Router.stop() still stops it on every normal exit


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def ip_literal(host: str) -> str:
    """A hostname resolved to an IP literal, as the router demands (IPv4 preferred)."""
    infos = socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)
    infos.sort(key=lambda i: i[0] != socket.AF_INET)
    return str(infos[0][4][0])  # the address of (address, port[, ...]): a str for IPv4 and IPv6


def _url_host(ip: str) -> str:
    return f"[{ip}]" if ":" in ip else ip


def _ip_url(url: str) -> str:
    """Worker URLs with hostnames rewritten to IPs: the router compares and dials them."""
    parts = urlsplit(url)
    netloc = _url_host(ip_literal(parts.hostname or "127.0.0.1")) + (f":{parts.port}" if parts.port else "")
    return urlunsplit((parts.scheme or "http", netloc, parts.path, "", "")).rstrip("/")


def router_command(ip: str, port: int | str, prom_port: int | str, policy: str, worker_urls: list[str],
                   python: str = sys.executable) -> list[str]:
    """The sglang-router's command line (the dry run prints it with placeholders)."""
    def word(v: int | str) -> str:
        return v if isinstance(v, str) else str(v)  # a str subclass (a dry run's placeholder) stays itself
    return [python, "-m", "sglang_router.launch_router", "--host", ip, "--port", word(port),
            "--prometheus-host", ip, "--prometheus-port", word(prom_port), "--policy", policy,
            *FAILURE_FLAGS, "--worker-urls", *worker_urls]


class Router:
    """Handle on one router process. One owner starts and stops it; `add_worker` and
    `remove_worker` may run in the fleet supervisor's threads meanwhile: they only call the
    router's HTTP API and append to / remove from `worker_urls` (atomic list operations)."""

    def __init__(self, proc: subprocess.Popen | None, url: str, log_path: str, worker_urls: list[str]) -> None:
        self.proc, self.url, self.log_path, self.worker_urls = proc, url, log_path, worker_urls

    @classmethod
    def attach(cls, url: str, worker_urls: list[str], log_path: str) -> Router:
        """A handle on a router another process started (e.g. a RouterActor): its HTTP API
        only; `stop` is a no-op, the router's owner stops it."""
        return cls(None, url, log_path, [_ip_url(u) for u in worker_urls])

    @classmethod
    def start(cls, worker_urls: list[str], policy: str = "round_robin", host: str = "127.0.0.1",
              timeout_s: float = 60.0, log_path: str | None = None) -> Router:
        """Launch, then wait until every worker is listed in GET /workers."""
        ip = ip_literal(host)
        port, prom_port = free_port(ip), free_port(ip)
        workers = [_ip_url(u) for u in worker_urls]
        log_path = log_path or os.path.join(tempfile.mkdtemp(prefix="milepost-router-"), "router.log")
        cmd = router_command(ip, port, prom_port, policy, workers)
        with open(log_path, "ab") as log:
            proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    preexec_fn=_die_with_parent)
        router = cls(proc, f"http://{_url_host(ip)}:{port}", log_path, workers)
        try:
            router._wait_ready(timeout_s)
        except BaseException:
            router.stop()
            raise
        return router

    def _wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        missing: list[str] | None = list(self.worker_urls)
        while time.monotonic() < deadline:
            if self.proc is not None and self.proc.poll() is not None:
                raise RouterError(f"router exited with {self.proc.returncode}:\n{self.log_tail()}")
            missing = self._missing_workers()
            if missing is not None and not missing:
                return
            time.sleep(0.2)
        raise RouterError(f"router not ready in {timeout_s:.0f}s (workers not listed: {missing}):\n"
                          f"{self.log_tail()}")

    def _missing_workers(self) -> list[str] | None:
        """Workers not yet in GET /workers, or None while the router does not answer."""
        try:
            reply = httpx.get(f"{self.url}/workers", timeout=2.0)
        except httpx.HTTPError:
            return None
        if reply.status_code != 200:
            return None
        try:
            listed = {w.get("url") for w in reply.json().get("workers", [])}
        except (ValueError, AttributeError):
            return None
        return [u for u in self.worker_urls if u not in listed]

    def workers(self) -> list[dict]:
        """GET /workers: [{"id", "url", "is_healthy", …}]."""
        reply = httpx.get(f"{self.url}/workers", timeout=5.0)
        reply.raise_for_status()
        return list(reply.json().get("workers", []))

    def add_worker(self, url: str, timeout_s: float = 60.0) -> None:
        """POST /workers, then wait until GET /workers lists it healthy (registration is async)."""
        url = _ip_url(url)
        reply = httpx.post(f"{self.url}/workers", json={"url": url, "worker_type": "regular"}, timeout=10.0)
        if reply.status_code >= 400:
            raise RouterError(f"router refused worker {url}: {reply.status_code} {reply.text[:300]}")
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if any(w.get("url") == url and w.get("is_healthy", True) for w in self._try_workers()):
                self.worker_urls.append(url)
                return
            time.sleep(0.1)
        raise RouterError(f"worker {url} not listed healthy by the router in {timeout_s:.0f}s:\n{self.log_tail()}")

    def remove_worker(self, url: str) -> bool:
        """DELETE every entry of `url`; False if the router did not list it."""
        url = _ip_url(url)
        ids = [w["id"] for w in self._try_workers() if w.get("url") == url and "id" in w]
        for worker_id in ids:
            httpx.delete(f"{self.url}/workers/{worker_id}", timeout=10.0)
        if url in self.worker_urls:
            self.worker_urls.remove(url)
        return bool(ids)

    def _try_workers(self) -> list[dict]:
        try:
            return self.workers()
        except (httpx.HTTPError, ValueError):
            return []

    def log_tail(self, n_bytes: int = 4000) -> str:
        try:
            with open(self.log_path, "rb") as f:
                f.seek(max(0, os.path.getsize(self.log_path) - n_bytes))
                return f.read().decode(errors="replace")
        except OSError:
            return "(no router log)"

    def stop(self, timeout_s: float = 10.0) -> None:
        """Terminate this router's pid; kill it if it does not exit in time."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout_s)
