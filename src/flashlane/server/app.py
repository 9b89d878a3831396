"""The OpenAI-compatible HTTP app around an ``EngineClient`` (engine/launch.py: the engine on a
thread of this process, or in a supervised engine process of its own).

The app owns the engine's lifetime: it starts the engine on startup and, on shutdown,
refuses new work (503) and aborts whatever is still in flight (uvicorn first lets open
connections drain for its graceful-shutdown timeout).
"""

from __future__ import annotations

import asyncio
import gc
import logging
from contextlib import asynccontextmanager

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import JSONResponse, Response

from ..engine.client import EngineClient
from .admission import Admission
from .body_limits import DEFAULT_MAX_SEQS_PER_REQUEST, BodyLimits, chars_per_token
from .chat_completions import create_chat_completion
from .completions import create_completion
from .debug_steps import debug_steps_router
from .errors import install_error_handlers
from .guard import GuardedRoute, MemoryReleaser, ReleaseMemoryAfterLargeBodies
from .handler_context import ServerContext
from .head import HeadAsGet
from .metrics import CONTENT_TYPE, ServerMetrics
from .middleware import CountStatus, LimitBody, RequireApiKey
from .profiling import profile_router
from .protocol import (ChatCompletionRequest, ChatCompletionResponse, CompletionRequest, CompletionResponse,
                       ErrorResponse, ModelCard, ModelList)
from .retry_after import RetryAfterWhileRestarting
from .shutdown import AnswerCancelledAtShutdown
from .tokenize import tokenize_router

DEFAULT_MAX_BODY_BYTES = 32 * 1024 * 1024

log = logging.getLogger("flashlane.server")

_ERRORS = {code: {"model": ErrorResponse} for code in (400, 401, 404, 413, 429, 503)}
_STREAM = {"content": {"text/event-stream": {}}, "description": "JSON, or SSE events when stream is true"}


def create_app(engine: EngineClient, served_model_name: str | None = None, api_key: str | None = None,
               max_queue: int | None = None, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
               max_seqs_per_request: int = DEFAULT_MAX_SEQS_PER_REQUEST, profile_dir: str | None = None,
               max_tokens_default: int | None = None) -> FastAPI:
    """``max_queue``: sequences allowed to wait beyond the engine's running capacity (None: no
    bound); more are refused with 429. ``max_seqs_per_request``: engine requests (prompts x n)
    one HTTP request may ask for; more are refused with 400 before anything is tokenised.
    ``profile_dir``: where ``POST /stop_profile`` writes traces (None: the profile endpoints answer 404).
    ``max_tokens_default``: tokens to generate when a request names no max_tokens (None: completions
    16, chat the rest of the context)."""
    info = engine.info
    name = served_model_name or info.model
    _check_options(max_queue, max_seqs_per_request, max_tokens_default)
    ctx = _server_context(engine, info, name, max_queue, max_seqs_per_request, max_tokens_default)
    app = FastAPI(title="flashlane", summary="OpenAI-compatible server for flashlane models",
                  lifespan=_lifespan(engine, ctx))
    app.state.ctx = ctx
    install_error_handlers(app)
    _add_status_routes(app, engine, info, name, ctx)
    app.include_router(debug_steps_router(engine, _ERRORS))
    app.include_router(profile_router(engine, profile_dir, _ERRORS))
    app.include_router(tokenize_router(ctx, _ERRORS))
    app.include_router(_generation_router(ctx))
    _add_middleware(app, engine, ctx, api_key, max_body_bytes)
    return app


def _check_options(max_queue: int | None, max_seqs_per_request: int, max_tokens_default: int | None):
    if max_queue is not None and max_queue < 0:
        raise ValueError(f"max_queue must be >= 0, got {max_queue}")
    if max_seqs_per_request < 1:
        raise ValueError(f"max_seqs_per_request must be >= 1, got {max_seqs_per_request}")
    if max_tokens_default is not None and max_tokens_default < 1:
        raise ValueError(f"max_tokens_default must be >= 1, got {max_tokens_default}")


def _server_context(engine: EngineClient, info, name: str, max_queue: int | None, max_seqs_per_request: int,
                    max_tokens_default: int | None) -> ServerContext:
    limit = None if max_queue is None else info.max_running + max_queue
    ctx = ServerContext(engine, name, ServerMetrics(name), Admission(limit), max_tokens_default=max_tokens_default)
    max_len = info.max_model_len
    ctx.body_limits = BodyLimits(max_model_len=max_len, chars_per_token=chars_per_token(engine.tokenizer),
                                 max_seqs=max_seqs_per_request, max_messages=max_len)
    if ctx.body_limits.max_prompt_chars is None:
        log.info("prompt length is checked after tokenising (this tokenizer gives no bound on characters per token)")
    else:
        log.info("prompts over %d characters are refused before tokenising (%d tokens x %d characters per token)",
                 ctx.body_limits.max_prompt_chars, max_len - 1, ctx.body_limits.chars_per_token)
    return ctx


def _lifespan(engine: EngineClient, ctx: ServerContext):
    @asynccontextmanager
    async def lifespan(_: FastAPI):
        engine.start()
        # what start-up made (~220k objects: model code, tokenizer) leaves the cyclic GC's full
        # collections, which otherwise hold the GIL 0.15-0.35 s while a large request is served
        gc.freeze()
        try:
            yield
        finally:
            ctx.admission.closed = True
            await asyncio.to_thread(engine.shutdown)

    return lifespan


def _add_status_routes(app: FastAPI, engine: EngineClient, info, name: str, ctx: ServerContext):
    """/health (GET and HEAD), /v1/models and /metrics."""

    @app.get("/health", responses={503: {"model": ErrorResponse}})
    async def health():
        state = engine.state   # running, restarting (a supervised engine process) or dead
        if state == "running":
            return {"status": "ok"}
        # a restarting engine's 503 gets Retry-After from RetryAfterWhileRestarting
        return JSONResponse({"status": "restarting" if state == "restarting" else "error",
                             "error": repr(engine.error)}, status_code=503)

    # HEAD: the same status without a body (what load balancers and `curl -I` send)
    app.head("/health", operation_id="health_head", responses={503: {"model": ErrorResponse}})(health)

    @app.get("/v1/models", response_model=ModelList, responses=_ERRORS)
    async def models():
        report = info.report()
        report["cache_bytes_per_token"] = sum(report["pool_bytes_per_token"].values())  # scale pools too
        report["state_bytes_per_sequence"] = report["bytes_per_slot"]
        card = ModelCard(id=name, root=info.model, max_model_len=info.max_model_len, flashlane=report)
        return ModelList(data=[card])

    last_snapshot: dict = {}

    @app.get("/metrics", response_class=Response, responses=_ERRORS)
    async def metrics():
        try:
            last_snapshot.update(await engine.stats_snapshot())
        except asyncio.TimeoutError:  # a very long step: answer with the previous numbers
            pass
        return Response(ctx.metrics.render(dict(last_snapshot)), media_type=CONTENT_TYPE)


def _generation_router(ctx: ServerContext) -> APIRouter:
    # generation bodies are read by GuardedRoute: bounded before validation, large ones off the loop
    generation = APIRouter(route_class=GuardedRoute)

    @generation.post("/v1/completions", response_model=CompletionResponse, responses={**_ERRORS, 200: _STREAM})
    async def completions(body: CompletionRequest, request: Request):
        return await create_completion(ctx, body, request)

    @generation.post("/v1/chat/completions", response_model=ChatCompletionResponse,
                     responses={**_ERRORS, 200: _STREAM})
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        return await create_chat_completion(ctx, body, request)

    return generation


def _add_middleware(app: FastAPI, engine: EngineClient, ctx: ServerContext, api_key: str | None,
                    max_body_bytes: int):
    # outermost last: count every status, answer requests cancelled at shutdown, then check the
    # key, then the body size, then give memory back after large bodies, then add Retry-After to
    # 503s while the engine restarts, then route HEAD as GET
    app.add_middleware(HeadAsGet)
    app.add_middleware(RetryAfterWhileRestarting, engine=engine)
    app.add_middleware(ReleaseMemoryAfterLargeBodies, releaser=MemoryReleaser())
    app.add_middleware(LimitBody, max_bytes=max_body_bytes)
    app.add_middleware(RequireApiKey, api_key=api_key)
    app.add_middleware(AnswerCancelledAtShutdown, admission=ctx.admission)  # see shutdown.py
    app.add_middleware(CountStatus, metrics=ctx.metrics)
