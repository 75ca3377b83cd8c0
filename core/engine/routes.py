"""The built-in engine's HTTP routes: SGLang's server API (../shared/SGLANG-PROTOCOL.md) over
a `Scheduler`. Request reading and answer shapes are in protocol.py; the weight-update,
LoRA and weight-read routes add themselves (weight_routes.py, lora_adapter.py, quantized.py).
"""

from __future__ import annotations

import asyncio
import math
import time
import uuid
from collections.abc import Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from milepost.core.engine.generation import SamplingParams, make_sequences
from milepost.core.engine.lora_adapter import add_lora_routes, requested_adapters
from milepost.core.engine.memory import parse_tags
from milepost.core.engine.protocol import (
    FLUSHED_TEXT,
    BadRequest,
    check_size,
    error_response,
    parse_sampling_list,
    read_json,
    read_prompts,
    read_push_id,
    response,
)
from milepost.core.engine.quantized import add_weights_route
from milepost.core.engine.routing_capture import check_start_len
from milepost.core.engine.scheduler import Scheduler
from milepost.core.engine.weight_routes import add_weight_routes, client_gone
from milepost.core.weight_sync.cuda_buffers import CUDA_FORMAT
from milepost.core.weight_sync.groups import MAX_GLOO_STREAMS
from milepost.core.weight_sync.wire import SHM_FORMAT

MAX_FLUSH_WAIT_S = 300.0  # the longest `?timeout=` of /flush_cache


async def _memory_call(request: Request, call: Callable[[list[str]], tuple[int, str]]) -> JSONResponse:
    """/release_memory_occupation or /resume_memory_occupation: `call` takes the tags."""
    tags = parse_tags(await read_json(request) if await request.body() else {})
    if isinstance(tags, str):
        raise BadRequest(tags)
    status, message = await asyncio.to_thread(call, tags)
    return JSONResponse({"success": status == 200, "message": message}, status_code=status)


def create_app(sched: Scheduler) -> FastAPI:
    """The engine's app over `sched` (serve() puts it behind http_guard.guard)."""
    app = FastAPI(docs_url=None, redoc_url=None, openapi_url=None)  # only the protocol's routes

    @app.exception_handler(BadRequest)
    async def _bad(_: Request, exc: BadRequest) -> JSONResponse:
        return error_response(str(exc))

    @app.post("/generate")
    async def generate(request: Request) -> Any:
        body, t0 = await read_json(request), time.time()
        if not sched.ready:
            return error_response("model is loading", 503)
        if problem := sched.memory.serving_problem():
            return error_response(problem, 503)
        if body.get("stream"):
            raise BadRequest("streaming is not supported by the built-in engine")
        prompts, batched = read_prompts(body, sched.tokenizer, sched.vocab_size)
        per_input, n, skip = parse_sampling_list(body.get("sampling_params"), len(prompts))
        check_size(prompts, max(per_input, key=lambda p: p.max_new_tokens), n, sched.context_len)
        start = body.get("logprob_start_len", -1)
        if not isinstance(start, int) or isinstance(start, bool) or not -1 <= start < min(len(p) for p in prompts):
            raise BadRequest("`logprob_start_len` must be an int in [-1, prompt length)")
        rid = body.get("rid") or uuid.uuid4().hex
        seqs = [s for p, params in zip(prompts, per_input) for s in make_sequences(p, params, n, str(rid), start)]
        try:
            check_start_len(body, prompts, sched.routed_experts)
            adapters = requested_adapters(body, len(prompts))
            sched.lora.check_requested(adapters)
        except ValueError as exc:  # SGLang's texts: an unknown adapter, LoRA not enabled; routes not enabled
            raise BadRequest(str(exc)) from None
        for i, s in enumerate(seqs):
            s.lora_name = adapters[i // n]
        await sched.submit(seqs)
        out = [response(s, sched.tokenizer, body, skip, t0, sched.weight_version) for s in seqs]
        return out if (batched or n > 1) else out[0]

    @app.post("/update_weights_from_disk")
    async def update_weights(request: Request) -> Any:
        body = await read_json(request)
        if not isinstance(body.get("model_path"), str):
            raise BadRequest("`model_path` (str) is required")
        if sched.receiver.in_session():
            raise BadRequest("a weight-update session is open: end it before loading from disk")
        ok, msg = await asyncio.to_thread(
            sched.update_weights, body["model_path"], body.get("weight_version"),
            bool(body.get("flush_cache", True)), bool(body.get("abort_all_requests", False)))
        return JSONResponse({"success": ok, "message": msg}, status_code=200 if ok else 400)

    @app.post("/pause_generation")
    async def pause(request: Request) -> Any:
        body = await read_json(request)
        mode, push_id = body.get("mode", "abort"), read_push_id(body)
        if mode not in ("abort", "retract", "in_place"):
            raise BadRequest("`mode` must be abort, retract or in_place")
        if await client_gone(request):  # its caller timed out (e.g. we were stopped) and may
            raise BadRequest("client went away")  # already have sent continue: do not pause
        if not await asyncio.to_thread(sched.pause, mode, push_id):
            return JSONResponse({"success": False, "message": f"ignored: push {push_id} was already continued "
                                 "(a stale pause)"}, status_code=409)
        return {"success": True, "message": f"paused ({mode})"}

    @app.post("/continue_generation")
    async def resume(request: Request) -> Any:
        sched.resume(read_push_id(await read_json(request) if await request.body() else {}))
        return {"success": True, "message": "continued"}

    @app.api_route("/flush_cache", methods=["GET", "POST"])
    async def flush(timeout: float = 0.0) -> Any:
        """SGLang's reply exactly (srt/entrypoints/http_server.py `flush_cache`): plain text,
        200 once nothing runs (queued requests count only while not paused), else 400 with
        the reason; `?timeout=` waits up to that many seconds for the engine to be idle."""
        if not (isinstance(timeout, (int, float)) and math.isfinite(timeout) and timeout >= 0):
            return Response("`timeout` must be a finite number >= 0\n", status_code=400)
        deadline = time.monotonic() + min(timeout, MAX_FLUSH_WAIT_S)
        while (problem := sched.flush_problem()) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if problem is None:
            return Response(FLUSHED_TEXT, status_code=200)
        return Response(problem + "\n", status_code=400)

    @app.post("/update_weight_version")
    async def update_version(request: Request) -> Any:
        body = await read_json(request)
        if not isinstance(body.get("new_version"), (str, int)):
            raise BadRequest("`new_version` is required")
        if body.get("abort_all_requests", True):
            sched.abort("all", "weight version updated")
        if sched.receiver.stage_version(str(body["new_version"])):
            return {"success": True, "message": f"weight_version {body['new_version']} takes effect at "
                                                "/end_weight_update, with the session's weights"}
        sched.weight_version = str(body["new_version"])
        return {"success": True, "message": f"weight_version={sched.weight_version}"}

    @app.post("/abort_request")
    async def abort_request(request: Request) -> Any:
        body = await read_json(request)
        sched.abort("all" if body.get("abort_all") else str(body.get("rid", "")), "aborted by request")
        return {"success": True, "message": "ok"}

    add_weight_routes(app, sched, sched.receiver)
    add_lora_routes(app, sched)
    add_weights_route(app, sched)

    @app.post("/release_memory_occupation")
    async def release_memory(request: Request) -> Any:
        return await _memory_call(request, sched.memory.release)

    @app.post("/resume_memory_occupation")
    async def resume_memory(request: Request) -> Any:
        return await _memory_call(request, sched.memory.resume)

    @app.get("/health")
    async def health() -> Any:
        return JSONResponse({}, status_code=200) if sched.ready else error_response("model is loading", 503)

    @app.get("/health_generate")
    async def health_generate() -> Any:
        if not sched.ready:
            return error_response("model is loading", 503)
        if problem := sched.memory.serving_problem():
            return error_response(problem, 503)
        await sched.submit(make_sequences([0], SamplingParams(max_new_tokens=1, temperature=0.0), 1, "health"))
        return JSONResponse({}, status_code=200)

    @app.get("/model_info")
    @app.get("/get_model_info")
    async def model_info() -> Any:
        return {"model_path": sched.model_path, "weight_version": sched.weight_version,
                "is_generation": True, "tokenizer_path": sched.model_path if sched.tokenizer else None}

    @app.get("/server_info")
    @app.get("/get_server_info")
    async def server_info() -> Any:
        return {"model_path": sched.model_path, "served_model_name": sched.model_path, "dp_size": 1,
                "tp_size": 1, "device": sched.device_type(),  # the weight-update group: gloo on cpu (groups.py)
                "decode_path": "fast" if sched.driver else "hf", "context_length": sched.context_len,
                "weight_version": sched.weight_version, "max_batch_size": sched.max_batch_size,
                "enable_deterministic_inference": sched.deterministic,
                "enable_return_routed_experts": sched.routed_experts,
                "max_gloo_streams": MAX_GLOO_STREAMS,  # /init_weights_update_group takes `gloo_streams`
                "accepts_push_id": True,  # /pause_generation and /continue_generation take `push_id`
                "end_weight_update_abort": True,  # /end_weight_update takes `abort` (discards the session)
                # /update_weights_from_tensor also takes (beside SGLang's pickle) milepost's shm descriptor
                # on a CPU, where it serves the trainer's host-memory files in place, and milepost's
                # CUDA descriptor on a GPU (trainer storages mapped once: weight_sync/cuda_buffers.py)
                "tensor_formats": [SHM_FORMAT] if sched.device_type() == "cpu" else [CUDA_FORMAT],
                "enable_lora": sched.lora.enabled,
                "max_lora_rank": sched.lora.max_rank, "lora_target_modules": sched.lora.target_modules,
                "quantization": sched.quantization}

    @app.get("/get_load")
    async def get_load() -> Any:
        return [{"num_tokens": sched.num_tokens()}]

    return app
