"""The OpenAI-compatible HTTP app around an AsyncEngine.

The app owns the engine's lifetime: it starts the stepping thread on startup and, on shutdown,
refuses new work (503) and aborts whatever is still in flight (uvicorn first lets open
connections drain for its graceful-shutdown timeout).
"""

from __future__ import annotations

import asyncio
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from ..engine.async_engine import AsyncEngine
from .admission import Admission
from .chat_completions import create_chat_completion
from .completions import create_completion
from .context import ServerContext
from .errors import install_error_handlers
from .metrics import CONTENT_TYPE, ServerMetrics
from .middleware import CountStatus, LimitBody, RequireApiKey
from .protocol import (ChatCompletionRequest, ChatCompletionResponse, CompletionRequest, CompletionResponse,
                       ErrorResponse, ModelCard, ModelList)

DEFAULT_MAX_BODY_BYTES = 32 * 1024 * 1024

_ERRORS = {code: {"model": ErrorResponse} for code in (400, 401, 404, 413, 429, 503)}
_STREAM = {"content": {"text/event-stream": {}}, "description": "JSON, or SSE events when stream is true"}


def create_app(engine: AsyncEngine, served_model_name: str | None = None, api_key: str | None = None,
               max_queue: int | None = None, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES) -> FastAPI:
    """``max_queue``: sequences allowed to wait beyond the engine's running capacity (None: no
    bound); more are refused with 429."""
    name = served_model_name or engine.engine.model_name
    if max_queue is not None and max_queue < 0:
        raise ValueError(f"max_queue must be >= 0, got {max_queue}")
    limit = None if max_queue is None else engine.engine.startup["max_running"] + max_queue
    ctx = ServerContext(engine, name, ServerMetrics(name), Admission(limit))

    @asynccontextmanager
    async def lifespan(_: FastAPI):
        engine.start()
        try:
            yield
        finally:
            ctx.admission.closed = True
            await asyncio.to_thread(engine.shutdown)

    app = FastAPI(title="flashlane", summary="OpenAI-compatible server for flashlane models",
                  lifespan=lifespan)
    app.state.ctx = ctx
    install_error_handlers(app)

    @app.get("/health", responses={503: {"model": ErrorResponse}})
    async def health():
        if not engine.alive:
            return JSONResponse({"status": "error", "error": repr(engine.error)}, status_code=503)
        return {"status": "ok"}

    @app.get("/v1/models", response_model=ModelList, responses=_ERRORS)
    async def models():
        eng = engine.engine
        report = dict(eng.startup)
        report["cache_bytes_per_token"] = report["latent_bytes_per_token"] + report["index_bytes_per_token"]
        report["state_bytes_per_sequence"] = report["bytes_per_slot"]
        card = ModelCard(id=name, root=eng.model_name, max_model_len=eng.max_model_len, flashlane=report)
        return ModelList(data=[card])

    last_snapshot: dict = {}

    @app.get("/metrics", response_class=Response, responses=_ERRORS)
    async def metrics():
        try:
            last_snapshot.update(await engine.stats_snapshot())
        except asyncio.TimeoutError:  # a very long step: answer with the previous numbers
            pass
        return Response(ctx.metrics.render(dict(last_snapshot)), media_type=CONTENT_TYPE)

    @app.post("/v1/completions", response_model=CompletionResponse, responses={**_ERRORS, 200: _STREAM})
    async def completions(body: CompletionRequest, request: Request):
        return await create_completion(ctx, body, request)

    @app.post("/v1/chat/completions", response_model=ChatCompletionResponse,
              responses={**_ERRORS, 200: _STREAM})
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        return await create_chat_completion(ctx, body, request)

    # outermost last: count every status, then check the key, then the body size
    app.add_middleware(LimitBody, max_bytes=max_body_bytes)
    app.add_middleware(RequireApiKey, api_key=api_key)
    app.add_middleware(CountStatus, metrics=ctx.metrics)
    return app
