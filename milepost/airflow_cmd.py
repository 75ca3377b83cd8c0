"""`milepost airflow up|down|status`: a real Airflow (`airflow standalone`: scheduler, triggerer,
dag processor, API server and UI; SQLite; LocalExecutor) on this machine, against the
project's dags folder, for trying the UI and for integration tests.

    milepost airflow up [--work runs/airflow] [--port N] [--parallelism 4]
    milepost airflow down [--work runs/airflow]

AIRFLOW_HOME is `<work>/home`; the log is `<work>/standalone.log`; `<work>/standalone.json`
records the pid (and its start time, so a reused pid is never signalled), the URL and the
home. Why a SIGINT default: a process started in the background of a non-interactive shell
inherits SIGINT *ignored*, and `airflow standalone` then ignores the INT it stops on (and
TERM leaves its children behind); restoring SIGINT before exec makes `kill -INT <pid>` stop
everything in ≈ 15 s. `down` sends that, waits, and only then kills what is left of the
recorded process's own descendants — never anything by name.
"""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import time
import urllib.request
from pathlib import Path
from typing import Any

import psutil

DEFAULT_WORK = "runs/airflow"
STATE_DOC = "standalone.json"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def standalone_env(home: Path, port: int, parallelism: int, no_auth: bool = False) -> dict[str, str]:
    from milepost.dags.airflow_home import airflow_env

    extra = {
        "AIRFLOW__API__HOST": "127.0.0.1", "AIRFLOW__API__PORT": str(port),
        "AIRFLOW__API__BASE_URL": f"http://127.0.0.1:{port}",
        "AIRFLOW__CORE__PARALLELISM": str(parallelism),  # 32 LocalExecutor workers by default
        "AIRFLOW__CORE__EXECUTION_API_SERVER_URL": f"http://127.0.0.1:{port}/execution/",
        "AIRFLOW__DAG_PROCESSOR__REFRESH_INTERVAL": "30",
        "AIRFLOW__API__WORKERS": "1",
    }
    if no_auth:  # tests only: every request is an admin's
        extra["AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_ALL_ADMINS"] = "True"
    return airflow_env(home, None, **extra)


def read_state(work: Path) -> dict[str, Any] | None:
    path = work / STATE_DOC
    return json.loads(path.read_text()) if path.exists() else None


def _process(state: dict[str, Any]) -> psutil.Process | None:
    """The recorded process, if it is still the one we started."""
    try:
        proc = psutil.Process(int(state["pid"]))
        if abs(proc.create_time() - float(state["pid_created_at"])) > 1.0 or proc.status() == psutil.STATUS_ZOMBIE:
            return None
        return proc
    except psutil.NoSuchProcess:
        return None


def healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/api/v2/monitor/health", timeout=5) as r:
            doc = json.loads(r.read())
    except (OSError, ValueError):
        return False
    return all((doc.get(part) or {}).get("status") == "healthy" for part in ("metadatabase", "scheduler",
                                                                             "triggerer"))


def up(work: str | Path = DEFAULT_WORK, port: int | None = None, parallelism: int = 4, no_auth: bool = False,
       timeout_s: float = 240.0, env_extra: dict[str, str] | None = None) -> dict[str, Any]:
    """Start `airflow standalone` and wait until it is healthy; its state (pid, url, home)."""
    work = Path(work).resolve()
    state = read_state(work)
    if state and _process(state):
        raise RuntimeError(f"an Airflow started here is already running (pid {state['pid']}, {state['url']}): "
                           f"`milepost airflow down --work {work}` first")
    home = work / "home"
    home.mkdir(parents=True, exist_ok=True)
    port = port or _free_port()
    env = {**standalone_env(home, port, parallelism, no_auth), **(env_extra or {})}
    log_path = work / "standalone.log"
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(["airflow", "standalone"], env=env, stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True,

                                preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    url = f"http://127.0.0.1:{port}"
    state = {"pid": proc.pid, "pid_created_at": psutil.Process(proc.pid).create_time(), "url": url,
             "home": str(home), "log": str(log_path), "started_at": time.time()}
    (work / STATE_DOC).write_text(json.dumps(state, indent=2))
    deadline = time.monotonic() + timeout_s
    while not healthy(url):
        if proc.poll() is not None:
            raise RuntimeError(f"airflow standalone exited ({proc.returncode}) while starting; see {log_path}")
        if time.monotonic() > deadline:
            down(work)
            raise RuntimeError(f"airflow standalone was not healthy after {timeout_s:.0f}s; see {log_path}")
        time.sleep(2.0)
    state["healthy_after_s"] = round(time.time() - state["started_at"], 1)
    password = home / "simple_auth_manager_passwords.json.generated"
    state["password_file"] = str(password) if password.exists() else None
    (work / STATE_DOC).write_text(json.dumps(state, indent=2))
    return state


def down(work: str | Path = DEFAULT_WORK, timeout_s: float = 60.0) -> bool:
    """Stop the Airflow that `up` started here (by its recorded pid); True if one was running."""
    work = Path(work).resolve()
    state = read_state(work)
    proc = _process(state) if state else None
    if proc is None:
        return False
    family = [proc, *proc.children(recursive=True)]
    proc.send_signal(signal.SIGINT)
    _, alive = psutil.wait_procs(family, timeout=timeout_s)
    for leftover in alive:  # only descendants of the process we started
        try:
            leftover.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(alive, timeout=10)
    (work / STATE_DOC).unlink(missing_ok=True)
    return True


def main(args: Any) -> int:
    """The `milepost airflow` subcommand (arguments parsed by milepost.cli)."""
    if args.action == "up":
        state = up(args.work, args.port, args.parallelism)
        print(f"Airflow is up at {state['url']} (pid {state['pid']}, healthy after {state['healthy_after_s']}s)\n"
              f"  user admin, password in {state['password_file']}\n  log: {state['log']}\n"
              f"  stop it with: milepost airflow down --work {args.work}")
    elif args.action == "down":
        print("stopped" if down(args.work) else f"no Airflow started from {args.work} is running")
    else:
        state = read_state(Path(args.work).resolve())
        running = bool(state and _process(state))
        print(f"running at {state['url']} (pid {state['pid']})" if running else "not running")
    return 0
