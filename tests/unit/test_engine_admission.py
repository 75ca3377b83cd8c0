"""The admission probe (core/fleet/admission.py) against real HTTP servers: an SGLang-like
build lacking /begin_weight_update (as older SGLang) is refused with its version and the
missing route; one naming model info the older way (/get_model_info) is admitted; the probe
runs no POST route (a GET on a POST-only route answers 405)."""

from __future__ import annotations

import socket
import threading
import time

import pytest
import uvicorn
from fastapi import FastAPI

from milepost.core.fleet.admission import REQUIRED_POST_ROUTES, EngineRefused, probe_engine


def _serve(app: FastAPI) -> tuple[str, uvicorn.Server]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    threading.Thread(target=server.run, daemon=True).start()
    deadline = time.monotonic() + 20
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.05)
    return f"http://127.0.0.1:{port}", server


def _fake_sglang(version: str, skip: set[str], model_info: str) -> tuple[FastAPI, list[str]]:
    app, called = FastAPI(), []
    for route in REQUIRED_POST_ROUTES:
        if route not in skip:
            app.post(route)(lambda route=route: called.append(route) or {"success": True})
    app.get("/server_info")(lambda: {"version": version, "admin_api_key": None})
    app.get(model_info)(lambda: {"weight_version": "0"})
    return app, called


def test_a_build_without_begin_weight_update_is_refused_with_its_version() -> None:
    app, called = _fake_sglang("0.4.6", {"/begin_weight_update", "/end_weight_update"}, "/get_model_info")
    url, server = _serve(app)
    try:
        with pytest.raises(EngineRefused) as refused:
            probe_engine(url, "sglang")
    finally:
        server.should_exit = True
    message = str(refused.value)
    assert "version 0.4.6" in message and "/begin_weight_update" in message and "/end_weight_update" in message
    assert "milepost[sglang]" in message and called == []


def test_older_model_info_route_is_enough_and_the_version_is_read() -> None:
    app, called = _fake_sglang("0.5.23", set(), "/get_model_info")
    url, server = _serve(app)
    try:
        caps = probe_engine(url, "sglang")
    finally:
        server.should_exit = True
    assert (caps.version, caps.model_info_route) == ("0.5.23", "/get_model_info") and called == []
