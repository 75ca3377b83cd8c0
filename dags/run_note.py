"""Setting the note of a DAG run (the Markdown text the Airflow UI shows on the run's page and
in its run list) from a task of that run.

Airflow 3 gives task code no database access (the task process's ORM is blocked) and its
execution API has no route that edits a run's note, so a running task sets it the way a user
would: through the public REST API, `PATCH /api/v2/dags/{dag_id}/dagRuns/{run_id}` with
`{"note": …}` (at most 1000 characters), authenticated with a JWT from `POST /auth/token`.

Where the API is and who the task is, in this order:
1. the Airflow connection `milepost_airflow_api` (e.g. the environment variable
   `AIRFLOW_CONN_MILEPOST_AIRFLOW_API='http://USER:PASSWORD@host:8080'`): a deployment's own
   service account;
2. `[api] base_url` of this Airflow, and the simple auth manager's password file of its
   `AIRFLOW_HOME` (what `milepost airflow up` runs: the local standalone);
3. `[api] base_url` without a token (an Airflow whose auth manager lets everyone in).

A note is a convenience: when it cannot be set, the task logs why and what to configure,
and the block goes on. Under `dag.test()` (embedded `milepost run`) there is no API server;
the driver sets the note in the run's database itself (dags/embedded.set_note_in_db).
"""

from __future__ import annotations

import json
import os
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass
from pathlib import Path

API_CONN_ID = "milepost_airflow_api"
_TIMEOUT_S = 30.0


@dataclass(frozen=True)
class ApiTarget:
    base_url: str
    username: str | None
    password: str | None
    source: str  # where these came from, for messages


def _from_connection() -> ApiTarget | None:
    from airflow.sdk import BaseHook
    from airflow.sdk.exceptions import AirflowNotFoundException

    try:
        conn = BaseHook.get_connection(API_CONN_ID)
    except AirflowNotFoundException:
        return None
    scheme = "https" if (conn.conn_type or "").lower() == "https" else "http"
    port = f":{conn.port}" if conn.port else ""
    base = (conn.extra_dejson or {}).get("base_url") or f"{scheme}://{conn.host}{port}"
    return ApiTarget(base.rstrip("/"), conn.login, conn.password, f"connection {API_CONN_ID}")


def _password_file() -> Path:
    from airflow.sdk.configuration import conf

    configured = conf.get("core", "simple_auth_manager_passwords_file", fallback=None)
    home = os.environ.get("AIRFLOW_HOME") or str(Path.home() / "airflow")
    return Path(configured or Path(home) / "simple_auth_manager_passwords.json.generated")


def api_target() -> ApiTarget:
    """Where the REST API is and whom to log in as (see the module docstring)."""
    found = _from_connection()
    if found:
        return found
    from airflow.sdk.configuration import conf

    base = (conf.get("api", "base_url", fallback=None) or "http://127.0.0.1:8080").rstrip("/")
    passwords = _password_file()
    if passwords.exists():
        users = json.loads(passwords.read_text() or "{}")
        if users:
            user, password = next(iter(users.items()))
            return ApiTarget(base, user, password, f"the simple auth manager's user {user} ({passwords})")
    return ApiTarget(base, None, None, "no credentials")


def _request(method: str, url: str, body: dict, token: str | None = None) -> dict:
    headers = {"Content-Type": "application/json"}
    if token:
        headers["Authorization"] = f"Bearer {token}"
    request = urllib.request.Request(url, method=method, data=json.dumps(body).encode(), headers=headers)
    with urllib.request.urlopen(request, timeout=_TIMEOUT_S) as response:
        return json.loads(response.read() or b"null") or {}


def _token(target: ApiTarget) -> str | None:
    if not target.username:
        return None
    doc = _request("POST", f"{target.base_url}/auth/token",
                   {"username": target.username, "password": target.password or ""})
    return doc["access_token"]


def set_run_note(dag_id: str, run_id: str, note: str) -> str | None:
    """Set the run's note through the REST API; None when done, else why not (with the fix)."""
    target = api_target()
    url = (f"{target.base_url}/api/v2/dags/{urllib.parse.quote(dag_id, safe='')}/dagRuns/"
           f"{urllib.parse.quote(run_id, safe='')}?update_mask=note")
    try:
        _request("PATCH", url, {"note": note[:1000]}, _token(target))
    except urllib.error.HTTPError as e:
        detail = e.read().decode(errors="replace")[:300]
        return (f"the Airflow API at {target.base_url} answered {e.code} ({detail}) with {target.source}; "
                f"give the tasks an account that may edit DAG runs: the connection `{API_CONN_ID}` "
                f"(AIRFLOW_CONN_{API_CONN_ID.upper()}='http://USER:PASSWORD@host:port')")
    except (OSError, KeyError, ValueError) as e:
        return (f"the Airflow API at {target.base_url} could not be reached ({e}); set `[api] base_url` or the "
                f"connection `{API_CONN_ID}` to where the API server listens")
    return None
