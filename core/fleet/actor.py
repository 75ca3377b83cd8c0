"""Engine and router processes, each owned by a Ray actor.

`EngineActor.launch` starts one engine (built-in or SGLang: the same `EngineCommand` from
core/fleet/launcher.py) as a subprocess of the actor: its own process group, SIGKILLed
when the actor's process dies (PR_SET_PDEATHSIG, as the router), and its whole group
killed by `stop`. `launch` returns as soon as the process runs; the engine answers 503 (or
not at all) until its model is loaded. Waiting for it is the fleet supervisor's job, so one
start-up timeout (rollout.engine_startup_timeout_s, the cold-start budget), and only that,
applies to a warming engine.

An SGLang engine runs on a GPU bundle: the actor asks its bundle's GPUs, Ray sets
CUDA_VISIBLE_DEVICES for the actor, the engine inherits it and starts at `--base-gpu-id 0`.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any

import ray

from milepost.core.fleet.launcher import Deferred, EngineCommand, write_admin_config
from milepost.core.fleet.router import Router, _die_with_parent, free_port


def node_ip() -> str:
    """The IP literal Ray knows this node by: what other nodes reach it at."""
    return ray.util.get_node_ip_address()


@ray.remote(num_cpus=0.5, max_restarts=0)
class EngineActor:
    """Methods run one at a time (Ray's default); `launch` is called once per actor.

    The engine's stdout and stderr (and this actor's) go to `log_path`, which the
    supervisor quotes when it reports a dead engine: Ray's own worker logs are per node and
    named by worker id, so nobody would find them in a stage error.
    """

    def __init__(self, log_path: str) -> None:
        fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.close(fd)
        self.log_path = log_path
        self.proc: subprocess.Popen | None = None
        self.private_dir: str | None = None  # owner-only: the admin-key config while the engine starts

    def launch(self, command: EngineCommand, admin_key_path: str | None = None) -> tuple[str, int]:
        """Start the engine process from `command` (a template from `engine_command`: its node
        IP, free ports and admin-key config are filled in here, on the engine's node); returns
        (url, engine pid) at once, before the model is loaded. `admin_key_path`: a file with
        the admin key, read here and handed to the engine in an owner-only --config YAML that
        is deleted once the engine listens (the key itself never travels through Ray nor a
        command line)."""
        from milepost.core.engine_wire import read_key_file

        assert self.proc is None, "one engine per EngineActor"
        host = node_ip() if isinstance(command.host, Deferred) else command.host
        values: dict[str, Any] = {"host": host, "python": sys.executable if isinstance(command.python, Deferred)
                                  else command.python}
        if isinstance(command.port, Deferred):
            values["port"] = free_port(host)
        if isinstance(command.nccl_port, Deferred):
            values["nccl_port"] = free_port(host)
        if command.config_path is not None:
            if not admin_key_path:
                raise ValueError("the engine command asks for an admin-key config but no admin_key_path was given")
            self.private_dir = tempfile.mkdtemp(prefix="milepost-engine-")
            values["config_path"] = write_admin_config(read_key_file(admin_key_path), self.private_dir)
        cmd = command.resolve(**values)
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(cmd.argv(), stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         start_new_session=True, preexec_fn=_die_with_parent)
        print(f"engine pid {self.proc.pid} serving {cmd.model_path} (version {cmd.weight_version}) on "
              f"{host}:{cmd.port}: {cmd.render()}", flush=True)
        if self.private_dir:
            threading.Thread(target=self._forget_config_when_listening, args=(host, int(cmd.port)),
                             daemon=True, name="engine-config-cleanup").start()
        return f"http://{_url_host(host)}:{cmd.port}", self.proc.pid

    def _forget_config_when_listening(self, host: str, port: int) -> None:
        """Both engines read --config before they bind: once the port accepts, the key file goes."""
        import httpx  # an HTTP request, not a bare connect: servers log a connection closed unasked

        while self.proc is not None and self.proc.poll() is None:
            try:
                httpx.get(f"http://{_url_host(host)}:{port}/health", timeout=2.0)  # any answer: it listens
                break
            except httpx.HTTPError:
                time.sleep(0.5)
        self._remove_private_dir()

    def _remove_private_dir(self) -> None:
        if self.private_dir:
            shutil.rmtree(self.private_dir, ignore_errors=True)

    def status(self) -> dict[str, Any]:
        """{"pid", "alive", "exit_code"}: the engine process can exit (port taken, model load
        failed, crash) while this actor lives on."""
        code = None if self.proc is None else self.proc.poll()
        return {"pid": self.pid(), "alive": self.proc is not None and code is None, "exit_code": code}

    def pid(self) -> int:
        """The engine process's pid (this actor's before `launch`)."""
        return self.proc.pid if self.proc is not None else os.getpid()

    def stop(self, timeout_s: float = 10.0) -> None:
        """SIGTERM the engine's whole process group, SIGKILL it if it lingers."""
        if self.proc is not None:
            _kill_group(self.proc, timeout_s)
        self._remove_private_dir()

    def __del__(self) -> None:
        proc = getattr(self, "proc", None)  # None too when __init__ did not finish
        if proc is not None:
            _kill_group(proc, 0.0)


def _kill_group(proc: subprocess.Popen, timeout_s: float) -> None:
    """Stop `proc` and every process of its group (it leads one: start_new_session)."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            pass
        try:
            proc.wait(timeout_s if sig == signal.SIGTERM else 10.0)
            if sig == signal.SIGTERM:
                try:  # children that outlive their leader are still in the group
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            return
        except subprocess.TimeoutExpired:
            continue


def _url_host(ip: str) -> str:
    return f"[{ip}]" if ":" in ip else ip


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
        self.router = router = Router.start(worker_urls, policy=policy, host=host or node_ip(), log_path=self.log_path)
        assert router.proc is not None  # Router.start launched it
        return {"url": router.url, "pid": router.proc.pid, "actor_pid": os.getpid(), "log_path": self.log_path}

    def stop(self) -> None:
        if self.router is not None:
            self.router.stop()
