"""What the HTTP server needs from an engine, whichever runs it: ``AsyncEngine`` (a thread of the
server process) or ``EngineCoreClient`` (an engine-core process of its own)."""

from __future__ import annotations

import asyncio
from typing import AsyncIterator, Callable, Protocol

from .info import EngineInfo
from .outputs import RequestOutput
from .sampling_params import SamplingParams


class ServingEngine(Protocol):
    info: EngineInfo            # fixed once the model has loaded
    tokenizer: object           # a models.tokenizer.Tokenizer, or None (token ids only)
    error: BaseException | None  # why the engine stopped, once it has

    @property
    def alive(self) -> bool: ...

    def start(self) -> None: ...

    def shutdown(self, timeout: float = 10.0) -> None: ...

    def generate(self, request_id: str, prompt: str | list[int],
                 params: SamplingParams) -> AsyncIterator[RequestOutput]: ...

    async def stats_snapshot(self, timeout: float = 5.0) -> dict: ...

    async def step_page(self, since: float | None, limit: int, with_ids: bool) -> dict: ...

    async def start_profile(self) -> None: ...

    async def stop_profile(self, directory: str) -> dict: ...


async def request_outputs(q: asyncio.Queue, streams: dict, request_id: str,
                          abort: Callable[[str], object]) -> AsyncIterator[RequestOutput]:
    """A request's outputs from its queue, through the finished one (an exception put on the
    queue is raised). However the consumer leaves, the stream entry goes; if it leaves before the
    end, the request is aborted. Callers hold this in ``contextlib.aclosing`` so that happens
    when they are closed, not when the generator is collected."""
    finished = False
    try:
        while True:
            out = await q.get()
            if isinstance(out, BaseException):
                raise out
            yield out
            if out.finished:
                finished = True
                return
    finally:
        streams.pop(request_id, None)
        if not finished:
            abort(request_id)
