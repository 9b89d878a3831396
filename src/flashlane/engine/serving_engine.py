"""What the HTTP server needs from an engine, whichever runs it: ``AsyncEngine`` (a thread of the
server process), ``EngineCoreClient`` (an engine-core process of its own) or
``EngineCoreSupervisor`` (such a process, started again when it dies)."""

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

    @property
    def state(self) -> str: ...  # "running", "restarting" (a supervised engine process) or "dead"

    def start(self) -> None: ...

    def shutdown(self, timeout: float = 10.0) -> None: ...

    def abort_all(self) -> object: ...  # a future; does not wait for the aborts

    def generate(self, request_id: str, prompt: str | list[int],
                 params: SamplingParams) -> AsyncIterator[RequestOutput]: ...

    def generate_many(self, requests: list[tuple[str, list[int], SamplingParams]]
                      ) -> AsyncIterator[tuple[int, RequestOutput]]: ...  # (index in requests, output)

    def abort_many(self, request_ids: list[str]) -> object: ...

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


MERGED_BURST = 64   # outputs handed on before the consumer yields to the event loop once


async def merged_outputs(q: asyncio.Queue, streams: dict, index: dict[str, int],
                         abort_many: Callable[[list[str]], object]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """``request_outputs`` for many requests sharing one queue: ``(index[request_id], output)``
    through every request's finished output. However the consumer leaves, the stream entries go;
    the requests not finished are aborted together."""
    left = set(index)
    burst = 0
    try:
        while left:
            out = await q.get()
            if isinstance(out, BaseException):
                raise out
            if out.finished:
                left.discard(out.request_id)
            yield index[out.request_id], out
            burst += 1
            if burst == MERGED_BURST:  # q.get() on a queue that is never empty does not suspend
                burst = 0
                await asyncio.sleep(0)
    finally:
        for rid in index:
            streams.pop(rid, None)
        if left:
            abort_many(list(left))
