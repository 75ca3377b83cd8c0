"""HTTP client for engines (and the router) speaking SGLang's server protocol.

The same client drives the built-in engine and real SGLang. Control calls (pause, weight
updates) must go to each engine directly: sglang-router answers 404 to them.

Admin key: given one, the client sends `Authorization: Bearer <key>` with every request, as
SGLang expects with `--admin-api-key` (the read-only endpoints ignore it). The key lives
only in the HTTP client's headers: it is not an attribute, not in any message or repr.
Give the router's client no key: the router forwards the `authorization` header to the
engines, so the key would travel with every /generate for nothing.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, Protocol

import httpx

from milepost.core.engine_wire import bearer_header

FLUSH_MAX_ATTEMPTS = 60  # /flush_cache tries (Miles retries up to 60 times)
FLUSH_BACKOFF_S = (0.05, 1.0)  # first wait between tries, doubled up to the second


class EngineError(RuntimeError):
    """A failed engine call: `endpoint`, HTTP `status` (None if no reply) and `message`."""

    def __init__(self, endpoint: str, status: int | None, message: str) -> None:
        super().__init__(f"{endpoint} → {status if status is not None else 'no reply'}: {message}")
        self.endpoint, self.status, self.message = endpoint, status, message


def _server_message(reply: httpx.Response) -> str:
    """SGLang errors are {"error": {"message"}} or {"error": str}; fall back to the text."""
    try:
        body = reply.json()
    except ValueError:
        return reply.text[:500]
    if isinstance(body, dict):
        err = body.get("error", body.get("message", body.get("detail", body)))
        if isinstance(err, dict):
            err = err.get("message", err)
        return str(err)[:500]
    return str(body)[:500]


class GenerationClient(Protocol):
    """What a rollout calls on its router: EngineClient.generate (and base_url, for log lines).
    Rollouts get EngineClient or a wrapper with the same generate: RetryingClient (retries on an
    engine's loss), DirectEngines (picks an engine: MoE), AdapterRequests (names the LoRA adapter)."""

    base_url: str

    def generate(self, input_ids: list[int] | list[list[int]] | None = None,
                 sampling_params: dict[str, Any] | list[dict[str, Any]] | None = None, return_logprob: bool = False,
                 text: str | list[str] | None = None, timeout_s: float | None = None, **extra: Any) -> Any: ...


class EngineClient:
    """Sync client; every call has a timeout. Thread-safe (httpx.Client is)."""

    def __init__(self, base_url: str, timeout_s: float = 300.0, admin_key: str | None = None,
                 disk_form: Callable[[str], str] | None = None) -> None:
        self.base_url = base_url.rstrip("/")
        self.timeout_s = timeout_s
        # the folder this engine loads for an HF folder it is told to load (Fleet.disk_form):
        # every disk load (disk push, restart, wake, restore) goes through update_weights_from_disk
        self.disk_form = disk_form
        self._http = httpx.Client(timeout=timeout_s, headers=bearer_header(admin_key) if admin_key else None)
        self._server_info: dict[str, Any] | None = None  # asked once, for the extensions it announces

    def _call(self, method: str, endpoint: str, body: dict[str, Any] | None = None,
              timeout_s: float | None = None) -> Any:
        url = f"{self.base_url}{endpoint}"
        try:
            reply = self._http.request(method, url, json=body, timeout=timeout_s or self.timeout_s)
        except httpx.HTTPError as e:
            raise EngineError(f"{method} {url}", None, f"{type(e).__name__}: {e}") from e
        if reply.status_code >= 400:
            raise EngineError(f"{method} {url}", reply.status_code, _server_message(reply))
        return reply.json() if reply.content else {}

    def _control(self, endpoint: str, body: dict[str, Any], timeout_s: float | None = None) -> dict[str, Any]:
        """Calls answering {"success", "message"}. A failed update is HTTP 400 (as in SGLang),
        which raises; a 200 with success false is returned for the caller to judge."""
        return self._call("POST", endpoint, body, timeout_s)

    def generate(self, input_ids: list[int] | list[list[int]] | None = None,
                 sampling_params: dict[str, Any] | list[dict[str, Any]] | None = None, return_logprob: bool = False,
                 text: str | list[str] | None = None, timeout_s: float | None = None, **extra: Any) -> Any:
        """POST /generate; returns the parsed JSON (a list for batched input or n > 1).
        `sampling_params`: one object for every input, or a list with one per input."""
        body: dict[str, Any] = {"sampling_params": sampling_params or {}, "return_logprob": return_logprob, **extra}
        if input_ids is not None:
            body["input_ids"] = input_ids
        if text is not None:
            body["text"] = text
        return self._call("POST", "/generate", body, timeout_s)

    def update_weights_from_disk(self, model_path: str, weight_version: str | None = None,
                                 flush_cache: bool = True, abort_all_requests: bool = False,
                                 timeout_s: float | None = None) -> dict[str, Any]:
        if self.disk_form is not None:
            model_path = self.disk_form(model_path)
        return self._control("/update_weights_from_disk", {
            "model_path": model_path, "load_format": None, "abort_all_requests": abort_all_requests,
            "weight_version": weight_version, "flush_cache": flush_cache}, timeout_s)

    def load_lora_adapter(self, body: dict[str, Any], timeout_s: float | None = None) -> dict[str, Any]:
        """SGLang's /load_lora_adapter (LoadLoRAAdapterReqInput: lora_name, lora_path, pinned)."""
        return self._control("/load_lora_adapter", body, timeout_s)

    def unload_lora_adapter(self, body: dict[str, Any], timeout_s: float | None = None) -> dict[str, Any]:
        """SGLang's /unload_lora_adapter (UnloadLoRAAdapterReqInput: lora_name)."""
        return self._control("/unload_lora_adapter", body, timeout_s)

    def update_weight_version(self, new_version: str, abort_all_requests: bool = True,
                              timeout_s: float | None = None) -> dict[str, Any]:
        return self._control("/update_weight_version",
                             {"new_version": new_version, "abort_all_requests": abort_all_requests}, timeout_s)

    # ---- session weight updates: begin → update_* (buckets) → update_weight_version → end ----
    def begin_weight_update(self, selector: str = "all", timeout_s: float | None = None) -> dict[str, Any]:
        return self._control("/begin_weight_update", {"selector": selector}, timeout_s)

    def end_weight_update(self, abort: bool = False, timeout_s: float | None = None) -> dict[str, Any]:
        """Close the session. `abort` (milepost's extension, sent only to an engine whose
        /server_info announces `end_weight_update_abort`): the built-in engine discards what
        the session staged. SGLang loads each bucket at once: it has nothing to discard."""
        body = {"abort": True} if abort and self._announces("end_weight_update_abort", timeout_s) else {}
        return self._control("/end_weight_update", body, timeout_s)

    def update_weights_from_tensor(self, serialized_named_tensors: list[str],
                                   load_format: str | None = "flattened_bucket", flush_cache: bool = True,
                                   weight_version: str | None = None,
                                   timeout_s: float | None = None) -> dict[str, Any]:
        """One bucket; `serialized_named_tensors` holds one entry per TP rank (on CPU: a
        milepost.core.weight_sync.wire shared-memory descriptor)."""
        return self._control("/update_weights_from_tensor", {
            "serialized_named_tensors": serialized_named_tensors, "load_format": load_format,
            "flush_cache": flush_cache, "weight_version": weight_version}, timeout_s)

    def init_weights_update_group(self, master_address: str, master_port: int, rank_offset: int,
                                  world_size: int, group_name: str = "weight_update_group",
                                  backend: str = "nccl", timeout_s: float | None = None,
                                  gloo_streams: int = 1) -> dict[str, Any]:
        """Returns once every rank joined (the trainer, rank 0, must join meanwhile).
        `gloo_streams` > 1 (milepost's extension, sent only then) asks for that many gloo
        connections; only engines whose /server_info names `max_gloo_streams` take it."""
        body = {"master_address": master_address, "master_port": master_port, "rank_offset": rank_offset,
                "world_size": world_size, "group_name": group_name, "backend": backend}
        if gloo_streams > 1:
            body["gloo_streams"] = gloo_streams
        return self._control("/init_weights_update_group", body, timeout_s)

    def update_weights_from_distributed(self, names: list[str], dtypes: list[str], shapes: list[list[int]],
                                        group_name: str = "weight_update_group",
                                        load_format: str | None = None, flush_cache: bool = True,
                                        weight_version: str | None = None,
                                        timeout_s: float | None = None) -> dict[str, Any]:
        """One bucket; returns once the trainer's broadcast (src 0, same order) arrived."""
        return self._control("/update_weights_from_distributed", {
            "names": names, "dtypes": dtypes, "shapes": shapes, "group_name": group_name,
            "flush_cache": flush_cache, "weight_version": weight_version, "load_format": load_format}, timeout_s)

    def destroy_weights_update_group(self, group_name: str = "weight_update_group",
                                     timeout_s: float | None = None) -> dict[str, Any]:
        return self._control("/destroy_weights_update_group", {"group_name": group_name}, timeout_s)

    def pause(self, mode: str = "abort", timeout_s: float | None = None, push_id: str | None = None) -> dict[str, Any]:
        """`push_id` (one per weight push, also given to its continue) lets an engine that
        announces `accepts_push_id` ignore this pause if it arrives after that continue."""
        return self._call("POST", "/pause_generation", {"mode": mode, **self._push_field(push_id, timeout_s)},
                          timeout_s)

    def continue_generation(self, timeout_s: float | None = None, push_id: str | None = None) -> dict[str, Any]:
        return self._call("POST", "/continue_generation", self._push_field(push_id, timeout_s), timeout_s)

    def _push_field(self, push_id: str | None, timeout_s: float | None) -> dict[str, str]:
        """{"push_id": id} for an engine that announced it takes one (milepost's extension;
        SGLang would ignore the field, but extensions go only where announced), else {}."""
        if push_id is None:
            return {}
        return {"push_id": push_id} if self._announces("accepts_push_id", timeout_s) else {}

    def announces(self, extension: str, timeout_s: float | None = None) -> bool:
        """Whether the engine's /server_info announces milepost's `extension` (asked once)."""
        return self._announces(extension, timeout_s)

    def _announces(self, extension: str, timeout_s: float | None) -> bool:
        """Whether the engine's /server_info announces milepost's `extension` (asked once)."""
        if self._server_info is None:
            self._server_info = self.server_info(timeout_s)
        return bool(self._server_info.get(extension, False))

    def flush_cache(self, timeout_s: float | None = None) -> str:
        """POST /flush_cache until it answers 200; returns its text. SGLang answers plain
        text (never JSON: it is not parsed), 400 while requests are still running or waiting:
        that is retried with backoff (FLUSH_BACKOFF_S, at most FLUSH_MAX_ATTEMPTS tries, as
        Miles), all within `timeout_s`. Any other status, or no reply, raises at once."""
        url, budget = f"{self.base_url}/flush_cache", timeout_s or self.timeout_s
        end, delay, last = time.monotonic() + budget, FLUSH_BACKOFF_S[0], ""
        for _ in range(FLUSH_MAX_ATTEMPTS):
            left = end - time.monotonic()
            if left <= 0:
                break
            try:
                reply = self._http.post(url, timeout=left)
            except httpx.HTTPError as e:
                raise EngineError(f"POST {url}", None, f"{type(e).__name__}: {e}") from e
            if reply.status_code == 200:
                return reply.text
            if reply.status_code != 400:
                raise EngineError(f"POST {url}", reply.status_code, reply.text[:500])
            last = reply.text.strip()[:500]
            time.sleep(max(0.0, min(delay, end - time.monotonic())))
            delay = min(delay * 2, FLUSH_BACKOFF_S[1])
        raise EngineError(f"POST {url}", 400, f"cache not flushed within {budget:g} s ({last}): requests are "
                          "still running; pause generation first (mode abort or retract)")

    def abort_request(self, rid: str = "", abort_all: bool = False) -> Any:
        return self._call("POST", "/abort_request", {"rid": rid, "abort_all": abort_all})

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

    def release_memory_occupation(self, tags: list[str] | None = None,
                                  timeout_s: float | None = None) -> dict[str, Any]:
        """Give back memory while a colocated trainer runs (tags: weights, kv_cache, cuda_graph)."""
        return self._control("/release_memory_occupation", {"tags": tags}, timeout_s)

    def resume_memory_occupation(self, tags: list[str] | None = None,
                                 timeout_s: float | None = None) -> dict[str, Any]:
        return self._control("/resume_memory_occupation", {"tags": tags}, timeout_s)

    def get_load(self, timeout_s: float | None = None) -> list[dict[str, Any]]:
        """GET /get_load: `[{"num_tokens": N}]`, tokens queued and running (per DP rank)."""
        return self._call("GET", "/get_load", None, timeout_s)

    def model_info(self, timeout_s: float | None = None) -> dict[str, Any]:
        return self._call("GET", "/model_info", None, timeout_s)

    def server_info(self, timeout_s: float | None = None) -> dict[str, Any]:
        return self._call("GET", "/server_info", None, timeout_s)

    def close(self) -> None:
        self._http.close()
