"""``GET /debug/steps``: the engine's step records, its own utilisation timeline.

Query: ``since`` (wall-clock seconds, ``time.time()``; records that end after it), ``limit``
(records per answer, oldest first; page on with ``since`` = the last record's ``end`` while
``more`` is true), ``request_ids`` (include each step's request ids; off by default, they make
the answer several times larger). ``dropped`` counts records the ring buffer (engine arg
``step_log_size``) has already overwritten: when it is > 0 and ``oldest_start`` is after the
window you asked for, the start of that window is missing. Same authentication as every other
endpoint but /health. While the engine is dead or restarting it answers 503.
"""

from __future__ import annotations

import time

from fastapi import APIRouter, Query
from fastapi.responses import JSONResponse

from ..engine.client import EngineClient
from .serving import engine_errors


def debug_steps_router(engine: EngineClient, responses: dict) -> APIRouter:
    router = APIRouter()

    @router.get("/debug/steps", responses=responses)
    async def debug_steps(since: float | None = Query(None, description="wall-clock seconds (time.time())"),
                          limit: int = Query(10_000, ge=1, le=100_000),
                          request_ids: bool = False):
        with engine_errors():   # a dead or restarting engine process: 503
            page = await engine.step_page(since, limit, request_ids)
        return JSONResponse({
            "clock": "time.time() seconds (start, end); durations from time.monotonic()",
            "now": time.time(), **page})

    return router
