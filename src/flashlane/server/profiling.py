"""``POST /start_profile`` and ``POST /stop_profile``: a torch.profiler window over live traffic
(vLLM's convention), enabled by ``flashlane serve --profile-dir DIR``.

The window opens and closes where the engine steps (its stepping thread, or the engine-core
process: torch.profiler records the thread it starts on), between two steps. Stopping writes a
Chrome / Perfetto trace into DIR, with the per-layer-type breakdown of the window's steps beside
it, and answers both paths. Without
``--profile-dir`` both endpoints answer 404 saying how to enable them; a second start while a
window is open, or a stop without one, answers 409.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

from fastapi import APIRouter

from ..engine.client import EngineClient
from .errors import APIError
from .serving import engine_errors


def profile_router(engine: EngineClient, profile_dir: str | None, responses: dict) -> APIRouter:
    router = APIRouter()
    directory = None if profile_dir is None else Path(profile_dir)
    window = {"open": False}
    lock = asyncio.Lock()
    responses = {**responses, 409: responses.get(400, {})}

    def enabled() -> Path:
        if directory is None:
            raise APIError(404, "profiling is off: start the server with --profile-dir DIR to enable "
                                "/start_profile and /stop_profile", code="profiling_disabled")
        return directory

    @router.post("/start_profile", responses=responses)
    async def start_profile():
        where = enabled()
        async with lock:
            if window["open"]:
                raise APIError(409, "a profiling window is already open: POST /stop_profile first",
                               code="profiler_running")
            with engine_errors():
                await engine.start_profile()
            window["open"] = True
        return {"status": "profiling", "profile_dir": str(where)}

    @router.post("/stop_profile", responses=responses)
    async def stop_profile():
        where = enabled()
        async with lock:
            if not window["open"]:
                raise APIError(409, "no profiling window is open: POST /start_profile first",
                               code="profiler_not_running")
            window["open"] = False
            with engine_errors():
                written = await engine.stop_profile(str(where))
        return {"status": "stopped", **written}

    return router
