"""What an engine must offer before the fleet admits it: read once, at its first healthy answer.

`probe_engine` reads `/server_info` (SGLang reports its `version` there; the built-in engine
is named by the fleet, which launched it) and probes the routes milepost drives. A probe is
a GET on a POST-only route, which runs nothing: 405 means the route exists, 404 that this
build lacks it (older SGLang builds have no `/begin_weight_update`; the model-info route is
`/model_info` in newer builds and `/get_model_info` in older ones, so either is enough).
Routes that also answer GET (`/flush_cache`, `/release_memory_occupation`, …) would act on
a GET and are never probed. Nothing of `/server_info` but the version and the device is
kept: SGLang's reply carries its server arguments.
"""

from __future__ import annotations

from dataclasses import dataclass

import httpx

from milepost.core.engine_wire import bearer_header

# POST-only in SGLang 0.5.23 (srt/entrypoints/http_server.py) and in the built-in engine.
REQUIRED_POST_ROUTES = (
    "/generate", "/update_weights_from_disk", "/pause_generation", "/continue_generation",
    "/update_weight_version", "/begin_weight_update", "/end_weight_update", "/update_weights_from_tensor",
    "/init_weights_update_group", "/update_weights_from_distributed", "/destroy_weights_update_group",
)
MODEL_INFO_ROUTES = ("/model_info", "/get_model_info")  # newer, older


class EngineRefused(RuntimeError):
    pass


@dataclass(frozen=True)
class EngineCapabilities:
    version: str
    model_info_route: str
    device: str = ""  # /server_info `device` ("cuda", "cpu"; "" when not reported)


def probe_engine(url: str, engine: str, admin_key: str | None = None, timeout_s: float = 10.0) -> EngineCapabilities:
    """The engine's version and routes, or `EngineRefused` naming its version and what is missing."""
    headers = bearer_header(admin_key) if admin_key else None
    with httpx.Client(base_url=url, timeout=timeout_s, headers=headers) as http:
        info = http.get("/server_info")
        if info.status_code == 404:
            info = http.get("/get_server_info")
        if info.status_code != 200:
            raise EngineRefused(f"{engine} engine at {url}: GET /server_info answered {info.status_code}; "
                                "milepost needs an SGLang 0.5.23-compatible server")
        body = info.json() if isinstance(info.json(), dict) else {}
        reported, device = body.get("version"), str(body.get("device") or "")
        version = str(reported) if reported else ("milepost built-in" if engine == "builtin" else "unknown")
        missing = [route for route in REQUIRED_POST_ROUTES if http.get(route).status_code == 404]
        model_info = next((r for r in MODEL_INFO_ROUTES if http.get(r).status_code == 200), None)
    if model_info is None:
        missing.append(" or ".join(MODEL_INFO_ROUTES))
    if missing or model_info is None:  # model_info None: its routes are in `missing`
        raise EngineRefused(f"{engine} engine at {url} (version {version}) lacks {', '.join(missing)}: milepost "
                            "drives SGLang 0.5.23's weight-update protocol; install that build "
                            "(pip install 'milepost[sglang]') or a newer one")
    return EngineCapabilities(version, model_info, device)
