"""HEAD on every GET route: the GET's status and headers without its body (what load balancers
and ``curl -I`` send). Starlette adds HEAD to its own GET routes, FastAPI's answer HEAD with 405;
routing a HEAD as a GET covers every route, including those of included routers, and adds
nothing to the OpenAPI schema."""

from __future__ import annotations


class HeadAsGet:
    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["method"] != "HEAD":
            return await self.app(scope, receive, send)

        async def without_body(message):
            if message["type"] == "http.response.body":
                message = {**message, "body": b""}
            await send(message)

        await self.app({**scope, "method": "GET"}, receive, without_body)
