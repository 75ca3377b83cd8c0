"""HTTP endpoints of session weight updates (shapes as in ../shared/SGLANG-PROTOCOL.md).

Every endpoint answers {"success", "message"}: 200 on success, 400 for a request that does
not fit (bad fields, no session, shapes that do not match), 409/503 when the engine is busy.
Blocking work runs in a thread; its waits are bounded by the receiver's timeouts.
Extensions of SGLang's bodies, each announced in /server_info: /init_weights_update_group
takes `gloo_streams` (TCP connections of a gloo group, groups.check_streams;
`max_gloo_streams`); /update_weights_from_tensor takes milepost's shared-memory descriptor
besides SGLang's pickled flattened bucket (`tensor_formats`); /end_weight_update takes
`abort` (`end_weight_update_abort`).
"""

from __future__ import annotations

import asyncio
import base64
import json
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from milepost.core.engine.weight_receiver import Reply, WeightReceiver
from milepost.core.weight_sync import cuda_buffers, sglang_wire, wire
from milepost.core.weight_sync.groups import check_streams

if TYPE_CHECKING:  # types only: the scheduler imports the parts of the engine
    from milepost.core.engine.scheduler import Scheduler

_REQUIRED = object()
GROUP = "weight_update_group"  # SGLang's default group name


class FieldError(Exception):
    pass


def _field(body: dict, key: str, kind: type | tuple[type, ...], default: Any = _REQUIRED) -> Any:
    if key not in body or body[key] is None:
        if default is _REQUIRED:
            raise FieldError(f"`{key}` is required")
        return default
    value = body[key]
    if not isinstance(value, kind) or (isinstance(value, bool) and kind is not bool):
        raise FieldError(f"`{key}` must be {getattr(kind, '__name__', kind)}, got {value!r:.80}")
    return value


def _reply(reply: Reply) -> JSONResponse:
    status, message = reply
    return JSONResponse({"success": status == 200, "message": message}, status_code=status)


async def _body(request: Request) -> dict:
    try:
        body = await request.json() if await request.body() else {}
    except ValueError as exc:
        raise FieldError(f"invalid JSON body: {exc}") from None
    if not isinstance(body, dict):
        raise FieldError("body must be a JSON object")
    return body


async def client_gone(request: Request) -> bool:
    """Did the caller hang up? A request that waited in the socket while the engine was
    stopped arrives together with its caller's FIN: yield briefly so the server reads that
    FIN before the handler acts (an acted-on stale pause would leave the engine paused)."""
    for _ in range(3):  # each turn of the event loop reads what its sockets hold
        await asyncio.sleep(0)
    return await request.is_disconnected()


def _specs(body: dict) -> list[wire.Spec]:
    names, dtypes, shapes = (_field(body, k, list) for k in ("names", "dtypes", "shapes"))
    if not len(names) == len(dtypes) == len(shapes):
        raise FieldError("`names`, `dtypes` and `shapes` must have the same length")
    for n, d, s in zip(names, dtypes, shapes):
        if not isinstance(n, str) or not isinstance(s, list) or not all(isinstance(x, int) and x >= 0 for x in s):
            raise FieldError(f"bad entry name={n!r:.80} shape={s!r:.80}")
        wire.parse_dtype(d)
    return [{"name": n, "dtype": d, "shape": s} for n, d, s in zip(names, dtypes, shapes)]


def _load_format(body: dict, allowed: tuple[Any, ...]) -> Any:
    fmt = body.get("load_format")
    if fmt not in allowed:
        raise FieldError(f"`load_format` {fmt!r} is not supported here; use one of {list(allowed)}")
    return fmt


def load_tensor_payload(receiver: WeightReceiver, blob: Any) -> str:
    """One TP rank's `serialized_named_tensors` entry: SGLang's format (a pickled flattened
    bucket, read only through sglang_wire's allow-list, copied into private shadows),
    milepost's CUDA descriptor (a trainer storage mapped once, copied into private shadows;
    cuda_buffers.py) or milepost's shared-memory descriptor (served in place; wire.py)."""
    if not isinstance(blob, str):
        raise FieldError("`serialized_named_tensors` entries must be base64 strings")
    if receiver.cuda.knows(blob):  # a CUDA descriptor read before (the same bucket, pushed again)
        return receiver.cuda.load(blob)
    try:
        raw = base64.b64decode(blob, validate=True)
    except ValueError as exc:
        raise FieldError(f"serialized_named_tensors is not base64: {exc}") from None
    if sglang_wire.looks_like_pickle(raw):
        return receiver.load_flat(*sglang_wire.decode(raw))
    body = _json_or_none(raw)
    if isinstance(body, dict) and body.get("format") == cuda_buffers.CUDA_FORMAT:
        return receiver.cuda.load(blob, body)
    return receiver.load_shm(wire.decode_shm_descriptor(blob))  # says what is wrong with anything else


def _json_or_none(raw: bytes) -> Any:
    try:
        return json.loads(raw)
    except ValueError:
        return None


def add_weight_routes(app: FastAPI, sched: Scheduler, receiver: WeightReceiver) -> None:
    """Register the session endpoints on `app`; `sched` answers `ready`."""

    async def run(request: Request, handler: Callable[[dict], Reply], skip_if_gone: bool = False) -> JSONResponse:
        if not sched.ready:
            return _reply((503, "model is loading"))
        try:
            body = await _body(request)
            if skip_if_gone and await client_gone(request):  # its caller gave up: no effect
                return _reply((400, "client went away"))
            return _reply(await asyncio.to_thread(handler, body))
        except (FieldError, ValueError) as exc:
            return _reply((400, str(exc)))
        except Exception as exc:  # noqa: BLE001 - e.g. a group rendezvous that timed out
            return _reply((500, f"{type(exc).__name__}: {exc}"))

    @app.post("/begin_weight_update")
    async def begin(request: Request) -> Any:
        return await run(request, lambda b: receiver.begin(_field(b, "selector", str, "all")), skip_if_gone=True)

    @app.post("/end_weight_update")
    async def end(request: Request) -> Any:
        return await run(request, lambda b: receiver.end(abort=bool(b.get("abort", False))))

    @app.post("/update_weights_from_tensor")
    async def from_tensor(request: Request) -> Any:
        def handle(b: dict) -> Reply:
            _load_format(b, ("flattened_bucket",))
            blobs = _field(b, "serialized_named_tensors", list)
            if len(blobs) != 1:
                raise FieldError(f"`serialized_named_tensors` needs one entry per TP rank (1 here), got {len(blobs)}")
            return receiver.run_update(lambda: load_tensor_payload(receiver, blobs[0]),
                                       bool(b.get("flush_cache", True)), b.get("weight_version"))
        return await run(request, handle)

    @app.post("/init_weights_update_group")
    async def init_group(request: Request) -> Any:
        def handle(b: dict) -> Reply:
            backend = _field(b, "backend", str, "nccl")
            device = sched.device_type()
            if backend not in ("gloo", "nccl") or (backend == "nccl" and device != "cuda"):
                allowed = "gloo or nccl" if device == "cuda" else "gloo"
                raise FieldError(f"this built-in engine runs on {device}: `backend` must be {allowed}, got {backend}")
            streams = _field(b, "gloo_streams", int, 1)  # milepost's extension; SGLang has one stream
            check_streams(streams)  # ValueError: a 400 like a FieldError
            return receiver.groups.init(_field(b, "master_address", str), _field(b, "master_port", int),
                                        _field(b, "rank_offset", int), _field(b, "world_size", int),
                                        _field(b, "group_name", str, GROUP), backend, streams)
        return await run(request, handle)

    @app.post("/update_weights_from_distributed")
    async def from_distributed(request: Request) -> Any:
        def handle(b: dict) -> Reply:
            flat = _load_format(b, (None, "flattened_bucket")) == "flattened_bucket"
            specs, group = _specs(b), _field(b, "group_name", str, GROUP)
            return receiver.run_update(lambda: receiver.groups.receive(specs, group, flat),
                                       bool(b.get("flush_cache", True)), b.get("weight_version"))
        return await run(request, handle)

    @app.post("/destroy_weights_update_group")
    async def destroy_group(request: Request) -> Any:
        return await run(request, lambda b: receiver.groups.destroy(_field(b, "group_name", str, GROUP)))

