"""HTTP client for engines (and the router) speaking SGLang's server protocol."""

from __future__ import annotations

from typing import Any

import httpx


class EngineError(RuntimeError):
    pass


class EngineClient:
    """Every call has a timeout; HTTP errors raise `EngineError` naming endpoint and status."""

    def __init__(self, base_url: str, timeout_s: float = 300.0) -> None:
        self.base_url = base_url.rstrip("/")
        self.timeout_s = timeout_s
        self._http = httpx.Client(timeout=timeout_s)

    def _call(self, method: str, endpoint: str, body: dict[str, Any] | None = None,
              timeout_s: float | None = None) -> Any:
        url = f"{self.base_url}{endpoint}"
        try:
            reply = self._http.request(method, url, json=body, timeout=timeout_s or self.timeout_s)
        except httpx.HTTPError as e:
            raise EngineError(f"{method} {url} failed: {type(e).__name__}: {e}") from e
        if reply.status_code >= 400:
            raise EngineError(f"{method} {url} → {reply.status_code}: {reply.text[:500]}")
        return reply.json() if reply.content else {}

    def generate(self, input_ids: list[int] | list[list[int]], sampling_params: dict[str, Any],
                 return_logprob: bool = False, **extra: Any) -> Any:
        body = {"input_ids": input_ids, "sampling_params": sampling_params,
                "return_logprob": return_logprob, **extra}
        return self._call("POST", "/generate", body)

    def update_weights_from_disk(self, model_path: str, weight_version: str | None = None,
                                 flush_cache: bool = True) -> dict[str, Any]:
        return self._call("POST", "/update_weights_from_disk", {
            "model_path": model_path, "load_format": None, "abort_all_requests": False,
            "weight_version": weight_version, "flush_cache": flush_cache})

    def update_weight_version(self, new_version: str, abort_all_requests: bool = True) -> dict[str, Any]:
        return self._call("POST", "/update_weight_version",
                          {"new_version": new_version, "abort_all_requests": abort_all_requests})

    def pause(self, mode: str = "abort") -> dict[str, Any]:
        return self._call("POST", "/pause_generation", {"mode": mode})

    def continue_generation(self) -> dict[str, Any]:
        return self._call("POST", "/continue_generation", {})

    def flush_cache(self) -> Any:
        return self._call("POST", "/flush_cache")

    def health(self, timeout_s: float = 5.0) -> bool:
        try:
            return self._http.get(f"{self.base_url}/health", timeout=timeout_s).status_code == 200
        except httpx.HTTPError:
            return False

    def health_generate(self, timeout_s: float = 30.0) -> bool:
        try:
            return self._http.get(f"{self.base_url}/health_generate", timeout=timeout_s).status_code == 200
        except httpx.HTTPError:
            return False

    def model_info(self) -> dict[str, Any]:
        return self._call("GET", "/model_info")

    def close(self) -> None:
        self._http.close()
