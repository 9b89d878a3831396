"""Plain ASGI middleware: status counting, API key, body size. They answer before FastAPI
parses anything, so a rejected request costs no JSON parsing and no engine work."""

from __future__ import annotations

import hmac
import json

from starlette.datastructures import Headers
from starlette.exceptions import HTTPException

from .errors import error_body

OPEN_PATHS = frozenset({"/health"})


async def _send_error(send, status: int, message: str, headers: dict[str, str] | None = None) -> None:
    body = json.dumps(error_body(status, message)).encode()
    raw = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    raw += [(k.lower().encode(), v.encode()) for k, v in (headers or {}).items()]
    await send({"type": "http.response.start", "status": status, "headers": raw})
    await send({"type": "http.response.body", "body": body})


class CountStatus:
    """Counts every HTTP response by status (an escaping exception counts as 500)."""

    def __init__(self, app, metrics):
        self.app, self.metrics = app, metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        seen = False

        async def counting_send(message):
            nonlocal seen
            if message["type"] == "http.response.start" and not seen:
                seen = True
                self.metrics.count_response(message["status"])
            await send(message)

        try:
            await self.app(scope, receive, counting_send)
        except Exception:
            if not seen:
                self.metrics.count_response(500)
            raise


class RequireApiKey:
    """``Authorization: Bearer KEY`` (or ``x-api-key: KEY``) on everything but /health."""

    def __init__(self, app, api_key: str | None):
        self.app = app
        self.key = api_key.encode() if api_key else None

    async def __call__(self, scope, receive, send):
        if self.key is None or scope["type"] != "http" or scope["path"] in OPEN_PATHS:
            return await self.app(scope, receive, send)
        headers = Headers(scope=scope)
        given = headers.get("x-api-key", "")
        auth = headers.get("authorization", "")
        if auth[:7].lower() == "bearer ":
            given = auth[7:].strip()
        if not hmac.compare_digest(given.encode(), self.key):
            return await _send_error(send, 401, "missing or invalid API key (send 'Authorization: Bearer <key>')",
                                     {"WWW-Authenticate": "Bearer"})
        return await self.app(scope, receive, send)


class LimitBody:
    """413 for bodies over ``max_bytes``: at once from Content-Length, or while reading a chunked
    body (FastAPI passes an HTTPException raised from receive through unchanged)."""

    def __init__(self, app, max_bytes: int):
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        message = f"request body exceeds the limit of {self.max_bytes} bytes"
        length = Headers(scope=scope).get("content-length")
        if length is not None and length.isdigit() and int(length) > self.max_bytes:
            return await _send_error(send, 413, message)
        total = 0

        async def limited_receive():
            nonlocal total
            msg = await receive()
            if msg["type"] == "http.request":
                total += len(msg.get("body", b""))
                if total > self.max_bytes:
                    raise HTTPException(413, message)
            return msg

        return await self.app(scope, limited_receive, send)
