"""What every HTTP request to the built-in engine passes before a handler sees it: the
admin key (SGLang's `--admin-api-key`) and the body size limit.

Admin key, as SGLang 0.5.23 checks it with only `--admin-api-key` set
(sglang/srt/utils/auth.py `decide_request_auth`; endpoints marked
`AuthLevel.ADMIN_OPTIONAL` in sglang/srt/entrypoints/http_server.py):
- the header is `Authorization: Bearer <key>` ("bearer" in any case, one space), compared
  in constant time;
- /health*, /ready*, /metrics* and OPTIONS are always open;
- the read-only endpoints (PUBLIC_ROUTES: /generate, /model_info, /server_info, /get_load
  and their aliases) are open: SGLang's NORMAL endpoints need a key only with `--api-key`;
- every other route, i.e. everything that changes state (weight updates of every transport
  with their sessions and groups, pause/continue, flush_cache, memory release/resume,
  abort_request, update_weight_version), answers 401 `{"error": "Unauthorized"}` without
  the key, before its handler runs: nothing changes. Rule of this engine (stricter than
  SGLang, which opens an endpoint nobody marked): a route is admin unless listed public,
  so a new endpoint is protected by default;
- with no admin key configured every endpoint is open (SGLang's behaviour without keys);
- an unknown path is left to the app (404), as in SGLang.

Body size: a request whose body exceeds `max_body_bytes` gets 413 before it is read whole
(Content-Length is checked first; a chunked body is counted as it arrives).

Both are pure ASGI middlewares: a `BaseHTTPMiddleware` would hide client disconnects,
which `weight_routes.client_gone` relies on (SGLang keeps its auth middleware ASGI-native
for the same reason).
"""

from __future__ import annotations

import json
import secrets
from collections.abc import Awaitable, Callable
from typing import Any

ALWAYS_OPEN_PREFIXES = ("/health", "/ready", "/metrics")
PUBLIC_ROUTES = frozenset({"/generate", "/model_info", "/get_model_info", "/server_info", "/get_server_info",
                           "/get_load"})
DEFAULT_MAX_BODY_MB = 64.0  # a batch of long token-id prompts is a few MB; weights travel outside HTTP

Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]


def bearer_matches(header: str | None, key: str) -> bool:
    """`header` is `Bearer <key>` (scheme in any case), compared in constant time."""
    scheme, _, token = (header or "").partition(" ")
    return scheme.lower() == "bearer" and secrets.compare_digest(token.encode(), key.encode())


def needs_admin(app: Any, scope: Scope) -> bool:
    """Whether the route this request matches is an admin one (see the module's rules)."""
    from starlette.routing import Match

    path = scope.get("path", "")
    if scope.get("method") == "OPTIONS" or path.startswith(ALWAYS_OPEN_PREFIXES):
        return False
    for route in app.router.routes:
        match, _ = route.matches(scope)
        if match == Match.FULL:
            return getattr(route, "path", path) not in PUBLIC_ROUTES
    return False  # unknown path or method: the app answers 404 / 405, changing nothing


async def _send_json(send: Send, status: int, body: dict[str, Any]) -> None:
    payload = json.dumps(body).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode())]})
    await send({"type": "http.response.body", "body": payload})


class AdminKeyMiddleware:
    """401 for an admin route called without `Authorization: Bearer <admin key>`."""

    def __init__(self, app: Any, admin_key: str, routes_of: Any) -> None:
        self.app, self.routes_of = app, routes_of
        self._key = admin_key

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and needs_admin(self.routes_of, scope):
            header = dict(scope.get("headers") or []).get(b"authorization", b"").decode("latin-1")
            if not bearer_matches(header, self._key):
                await _send_json(send, 401, {"error": "Unauthorized"})
                return
        await self.app(scope, receive, send)


class BodyLimitMiddleware:
    """413 for a body over `max_bytes`: declared (Content-Length), or counted while the body
    is read here, before the app runs; the app then gets the body in one message and later
    receives (a client's disconnect) from the server as usual."""

    def __init__(self, app: Any, max_bytes: int) -> None:
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope.get("headers") or []).get(b"content-length")
        if declared is not None and (not declared.isdigit() or int(declared) > self.max_bytes):
            await _send_json(send, 413, self._error())
            return
        chunks, size, more = [], 0, True
        while more:
            message = await receive()
            if message["type"] != "http.request":  # the client left before sending it all
                return
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            more = message.get("more_body", False)
            if size > self.max_bytes:
                await _send_json(send, 413, self._error())
                return
        pending = [{"type": "http.request", "body": b"".join(chunks), "more_body": False}]

        async def replay() -> dict[str, Any]:
            return pending.pop() if pending else await receive()

        await self.app(scope, replay, send)

    def _error(self) -> dict[str, Any]:
        return {"error": {"message": f"request body larger than {self.max_bytes} bytes: send less per request "
                                     "or start the engine with a larger --max-request-body-mb"}}


def guard(app: Any, admin_key: str | None, max_body_bytes: int) -> Any:
    """`app` behind the body limit and, when `admin_key` is set, the admin key check
    (checked first: an unauthenticated caller learns nothing about sizes)."""
    inner = BodyLimitMiddleware(app, max_body_bytes)
    return AdminKeyMiddleware(inner, admin_key, app) if admin_key else inner
