"""Abort work whose client has gone away.

Non-streaming handlers are raced against the connection's ``http.disconnect`` message (the body
is already read, so the next message from the server is the disconnect). Streams are aborted by
closing their body iterator when the response ends for whatever reason, so an engine request
never outlives its connection waiting for garbage collection.
"""

from __future__ import annotations

import asyncio
from typing import Awaitable, Callable, TypeVar

from fastapi import Request
from starlette.responses import StreamingResponse

from .streaming import SSE_HEADERS

T = TypeVar("T")


class ClientDisconnected(Exception):
    pass


async def _wait_for_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def cancel_on_disconnect(request: Request, work: Awaitable[T]) -> T:
    """Await ``work``; if the client disconnects first, cancel it and raise ClientDisconnected."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_for_disconnect(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except BaseException:
        task.cancel()
        watcher.cancel()
        raise
    if task.done():
        watcher.cancel()
        return task.result()
    task.cancel()
    await asyncio.wait({task})  # its engine requests are aborted before we return
    raise ClientDisconnected()


class EventStream(StreamingResponse):
    """An SSE response that closes its generator and runs ``on_close`` however it ends
    (finished, client gone, server shutting down)."""

    def __init__(self, events, on_close: Callable[[], None]):
        super().__init__(events, media_type="text/event-stream", headers=SSE_HEADERS)
        self._events = events
        self._on_close = on_close

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            try:
                await self._events.aclose()
            finally:
                self._on_close()
