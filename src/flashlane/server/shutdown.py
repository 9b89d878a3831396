"""What happens to requests still running when the graceful-shutdown deadline passes.

uvicorn's own answer is to cancel their tasks: a non-streaming request then gets a plain-text
500, a stream just stops, and every one logs a long traceback. Instead, at the deadline
``ShutdownDeadlineServer`` closes admission and aborts every engine request, so handlers end
through their normal path: a 503 in OpenAI's error shape, or a final error event and
``[DONE]`` on a stream. uvicorn's own cancellation comes ``CANCEL_GRACE_S`` later, only for a
handler that could not end by itself (a client not reading its stream, a request that reached
the engine after the abort); ``AnswerCancelledAtShutdown`` answers those the same way, with one
log line instead of a traceback.
"""

from __future__ import annotations

import asyncio
import json
import logging
import socket

import uvicorn

from .errors import error_body
from .streaming import DONE, sse

CANCEL_GRACE_S = 5.0
SHUTTING_DOWN = "the request was aborted: the server is shutting down"

log = logging.getLogger("flashlane.server")


def abort_in_flight(ctx, deadline_s: float) -> None:
    """Refuse new work and abort every engine request; each handler then sees its final
    output with finish_reason 'abort'."""
    ctx.admission.closed = True
    log.warning("shutdown deadline of %gs passed: aborting the %d sequence(s) still in flight",
                deadline_s, ctx.admission.in_flight)
    if ctx.engine.alive:
        ctx.engine.abort_all()


class ShutdownDeadlineServer(uvicorn.Server):
    """A uvicorn.Server whose ``config.timeout_graceful_shutdown`` is when in-flight requests
    are aborted (``abort_in_flight``); uvicorn cancels what is left ``grace_s`` after that."""

    def __init__(self, config: uvicorn.Config, ctx, grace_s: float = CANCEL_GRACE_S):
        self.deadline_s = config.timeout_graceful_shutdown
        if self.deadline_s is not None:
            config.timeout_graceful_shutdown = self.deadline_s + grace_s
        super().__init__(config)
        self.ctx = ctx

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        timer = None
        if self.deadline_s is not None:
            timer = asyncio.get_running_loop().call_later(self.deadline_s, abort_in_flight, self.ctx,
                                                          self.deadline_s)
        try:
            await super().shutdown(sockets)
        finally:
            if timer is not None:
                timer.cancel()


class AnswerCancelledAtShutdown:
    """ASGI middleware around every handler (only the status counter is outside it): a request
    cancelled while ``admission`` is closed (uvicorn's graceful-shutdown timeout) is answered
    503 in OpenAI's error shape, or, when its SSE stream has started, ended with an error event
    and ``[DONE]``; one log line, and the expected CancelledError goes no further (uvicorn
    would log it with a traceback)."""

    def __init__(self, app, admission):
        self.app, self.admission = app, admission

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        state = {"started": False, "sse": False, "complete": False}

        async def tracking_send(message):
            if message["type"] == "http.response.start":
                state["started"] = True
                content_type = dict(message.get("headers") or []).get(b"content-type", b"")
                state["sse"] = content_type.startswith(b"text/event-stream")
            elif message["type"] == "http.response.body" and not message.get("more_body", False):
                state["complete"] = True
            await send(message)

        try:
            await self.app(scope, receive, tracking_send)
        except asyncio.CancelledError:
            if not self.admission.closed:
                raise
            if state["complete"]:  # answered already: nothing left to say
                return
            log.warning("%s %s cancelled at the shutdown deadline: %s", scope.get("method"), scope.get("path"),
                        "answered 503" if not state["started"] else
                        "ended its stream with a 503 error event" if state["sse"] else "closed its response")
            await _finish(send, state)


async def _finish(send, state: dict) -> None:
    try:
        if not state["started"]:
            body = json.dumps(error_body(503, SHUTTING_DOWN)).encode()
            await send({"type": "http.response.start", "status": 503,
                        "headers": [(b"content-type", b"application/json"),
                                    (b"content-length", str(len(body)).encode()), (b"connection", b"close")]})
            await send({"type": "http.response.body", "body": body})
        elif state["sse"]:
            await send({"type": "http.response.body", "body": (sse(error_body(503, SHUTTING_DOWN)) + DONE).encode()})
        else:
            await send({"type": "http.response.body", "body": b""})
    except asyncio.CancelledError:  # cancelled again while a client that reads nothing blocks the send
        pass
