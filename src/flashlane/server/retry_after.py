"""``Retry-After`` on every 503 answered while the engine process restarts: the requests its
death failed, those refused meanwhile, and /health. It says about when the engine serves again
(``EngineClient.retry_after``, from the process transport), so clients wait instead of retrying at once or giving
up. A dead engine that will not restart gets none: retrying would not help."""

from __future__ import annotations

from ..engine.client import EngineClient


def retry_after(engine: EngineClient) -> int | None:
    """Seconds a client should wait, or None when waiting would not help."""
    # only a supervised engine process restarts
    return engine.retry_after if engine.state == "restarting" else None


class RetryAfterWhileRestarting:
    """Plain ASGI middleware adding ``Retry-After`` to 503s that have none."""

    def __init__(self, app, engine: EngineClient):
        self.app, self.engine = app, engine

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)

        async def send_with_retry_after(message):
            if message["type"] == "http.response.start" and message["status"] == 503:
                headers = list(message.get("headers") or [])
                seconds = None if any(k.lower() == b"retry-after" for k, _ in headers) else retry_after(self.engine)
                if seconds is not None:
                    message = {**message, "headers": [*headers, (b"retry-after", str(seconds).encode())]}
            await send(message)

        await self.app(scope, receive, send_with_retry_after)
