"""``POST /start_profile`` and ``POST /stop_profile``: a torch.profiler window over live traffic
(vLLM's convention), enabled by ``flashlane serve --profile-dir DIR``.

The window opens and closes on the engine's stepping thread (torch.profiler records the thread
it starts on), between two steps. Stopping writes a Chrome / Perfetto trace into DIR, with the
per-layer-type breakdown of the window's steps beside it, and answers both paths. Without
``--profile-dir`` both endpoints answer 404 saying how to enable them; a second start while a
window is open, or a stop without one, answers 409.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import time
from pathlib import Path

from fastapi import APIRouter

from ..engine.async_engine import AsyncEngine
from ..engine.profiling import StepProfiler, breakdown, per_unit, write_trace
from .errors import APIError
from .serving import engine_errors

_numbers = itertools.count()


def _write(prof, directory: Path) -> dict:
    stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime())
    stem = f"flashlane-{stamp}-{next(_numbers)}"
    trace = write_trace(prof, directory / f"{stem}.trace.json")
    summary = per_unit(breakdown(prof.events()))
    summary_path = directory / f"{stem}.profile.json"
    summary_path.write_text(json.dumps(summary, indent=2))
    return {"trace": str(trace), "summary": str(summary_path), "steps": summary["steps"],
            "ms_per_step": summary["ms"], "ms_between_steps": summary["between_steps_ms"]}


def profile_router(engine: AsyncEngine, profile_dir: str | None, responses: dict) -> APIRouter:
    router = APIRouter()
    directory = None if profile_dir is None else Path(profile_dir)
    window = StepProfiler()
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
            if window.active:
                raise APIError(409, "a profiling window is already open: POST /stop_profile first",
                               code="profiler_running")
            with engine_errors():
                await asyncio.wrap_future(engine.call_in_engine_thread(window.start))
        return {"status": "profiling", "profile_dir": str(where)}

    @router.post("/stop_profile", responses=responses)
    async def stop_profile():
        where = enabled()
        async with lock:
            if not window.active:
                raise APIError(409, "no profiling window is open: POST /start_profile first",
                               code="profiler_not_running")
            with engine_errors():
                prof = await asyncio.wrap_future(engine.call_in_engine_thread(window.stop))
        written = await asyncio.to_thread(_write, prof, where)
        return {"status": "stopped", **written}

    return router
