"""The engine on its own thread, feeding asyncio consumers (the HTTP server).

The stepping thread owns the LLMEngine; other threads talk to it only through a command queue,
so adds and aborts never race a step. Each request's outputs go to an asyncio.Queue on the
caller's event loop.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import queue
import threading
import time
from contextlib import aclosing
from typing import AsyncIterator

from ..kernels.profiling import profiling_range
from .info import EngineInfo
from .llm_engine import LLMEngine
from .outputs import RequestOutput
from .profiling import StepProfiler, write_window
from .request_batches import abort_each, add_all
from .sampling_params import SamplingParams
from .serving_engine import merged_outputs, request_outputs


class EngineDeadError(RuntimeError):
    pass


class AsyncEngine:
    def __init__(self, model, **engine_args):
        self.engine = LLMEngine(model, **engine_args)
        self._commands: queue.Queue = queue.Queue()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._profile = StepProfiler()
        self.error: BaseException | None = None

    # ---- lifecycle ---------------------------------------------------------------------------
    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="flashlane-engine", daemon=True)
            self._thread.start()

    def shutdown(self, timeout: float = 10.0) -> None:
        """Fail every in-flight request with finish_reason 'abort' and stop the thread."""
        if self._thread is None:
            return
        done = self._call(self._abort_all)
        deadline = time.monotonic() + timeout
        while self.error is None and not done.done() and time.monotonic() < deadline:
            concurrent.futures.wait([done], timeout=0.05)  # a crashed thread would never answer
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout)
        self._thread = None
        self.engine.close()

    @property
    def info(self) -> EngineInfo:
        return self.engine.info

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self.error is None

    @property
    def state(self) -> str:
        """"running" or "dead": a thread of this process cannot be restarted."""
        return "running" if self.alive else "dead"

    # ---- requests ----------------------------------------------------------------------------
    async def generate(self, request_id: str, prompt: str | list[int],
                       params: SamplingParams) -> AsyncIterator[RequestOutput]:
        """Yield a RequestOutput for every new token; the last one has ``finished`` set.
        If the consumer goes away (cancelled, disconnected), the request is aborted."""
        if not self.alive:
            raise EngineDeadError(f"engine is not running: {self.error!r}")
        loop = asyncio.get_running_loop()
        q: asyncio.Queue = asyncio.Queue()
        self._streams[request_id] = (loop, q)
        try:
            await asyncio.wrap_future(self._call(self.engine.add_request, request_id, prompt, params))
        except BaseException as exc:
            self._streams.pop(request_id, None)
            if not isinstance(exc, Exception):  # cancelled while the add may have gone through
                self._call(self.engine.abort, request_id)
            raise
        async with aclosing(request_outputs(q, self._streams, request_id,
                                            lambda rid: self._call(self.engine.abort, rid))) as outs:
            async for out in outs:
                yield out

    async def generate_many(self, requests: list[tuple[str, list[int], SamplingParams]]
                            ) -> AsyncIterator[tuple[int, RequestOutput]]:
        """``generate`` for many ``(request_id, prompt, params)`` at once, their outputs merged as
        ``(index in requests, output)``: added by one command (all or none), aborted by one if
        the consumer goes away before all have finished."""
        if not self.alive:
            raise EngineDeadError(f"engine is not running: {self.error!r}")
        q: asyncio.Queue = asyncio.Queue()
        index = {rid: i for i, (rid, _, _) in enumerate(requests)}
        target = (asyncio.get_running_loop(), q)
        for rid in index:
            self._streams[rid] = target
        try:
            await asyncio.wrap_future(self._call(add_all, self.engine, requests))
        except BaseException as exc:
            for rid in index:
                self._streams.pop(rid, None)
            if not isinstance(exc, Exception):  # cancelled while the add may have gone through
                self.abort_many(list(index))
            raise
        async with aclosing(merged_outputs(q, self._streams, index, self.abort_many)) as outs:
            async for item in outs:
                yield item

    def abort(self, request_id: str) -> concurrent.futures.Future:
        return self._call(self.engine.abort, request_id)

    def abort_many(self, request_ids: list[str]) -> concurrent.futures.Future:
        return self._call(abort_each, self.engine, list(request_ids))

    def abort_all(self) -> concurrent.futures.Future:
        """Abort every in-flight request without waiting; each stream gets its final output."""
        return self._call(self._abort_all)

    def stats(self) -> dict:
        return self.engine.stats()

    async def stats_snapshot(self, timeout: float = 5.0) -> dict:
        """stats() plus finish reasons, taken on the stepping thread between two steps (so the
        numbers agree with each other); read directly when the thread is not running."""
        if not self.alive:
            return self.engine.snapshot()
        return await asyncio.wait_for(asyncio.wrap_future(self._call(self.engine.snapshot)), timeout)

    async def step_page(self, since: float | None, limit: int, with_ids: bool) -> dict:
        """A page of the step log (``StepLog.page``); the log has its own lock."""
        return self.engine.step_stats.page(since, limit, with_ids)

    async def start_profile(self) -> None:
        """Open a torch.profiler window on the stepping thread, between two steps."""
        await asyncio.wrap_future(self.call_in_engine_thread(self._profile.start))

    async def stop_profile(self, directory: str) -> dict:
        """Close the window and write its trace and summary into ``directory`` (``write_window``)."""
        prof = await asyncio.wrap_future(self.call_in_engine_thread(self._profile.stop))
        return await asyncio.to_thread(write_window, prof, directory)

    def call_in_engine_thread(self, fn, *args) -> concurrent.futures.Future:
        """Run ``fn(*args)`` on the stepping thread between two steps (torch.profiler records
        the thread it is started on, so a live profiling window starts and stops here)."""
        if not self.alive:
            raise EngineDeadError(f"engine is not running: {self.error!r}")
        return self._call(fn, *args)

    # ---- the stepping thread -----------------------------------------------------------------
    def _call(self, fn, *args) -> concurrent.futures.Future:
        fut: concurrent.futures.Future = concurrent.futures.Future()
        self._commands.put((fn, args, fut))
        self._wake.set()
        return fut

    def _abort_all(self) -> None:
        for out in abort_each(self.engine, list(self.engine.requests)):
            self._deliver(out)

    def _deliver(self, out: RequestOutput) -> None:
        target = self._streams.get(out.request_id)
        if target is not None:
            loop, q = target
            loop.call_soon_threadsafe(q.put_nowait, out)

    # Commands and steps run in methods of their own: a loop's locals would keep the last
    # command's arguments and result (a batch of prompts, its aborted outputs) alive until the next.
    def _run_commands(self) -> None:
        while True:
            try:
                fn, args, fut = self._commands.get_nowait()
            except queue.Empty:
                return
            if not fut.set_running_or_notify_cancel():
                continue  # the caller gave up before it ran (e.g. a cancelled add)
            try:
                fut.set_result(fn(*args))
            except Exception as exc:  # reported to the caller, engine keeps going
                fut.set_exception(exc)

    def _step(self) -> None:
        with profiling_range("engine_step"):
            outputs = self.engine.step()
        for out in outputs:
            self._deliver(out)

    def _loop(self) -> None:
        try:
            while not self._stop.is_set():
                self._run_commands()
                if self.engine.has_unfinished():
                    self._step()
                else:
                    self._wake.wait(0.05)
                    self._wake.clear()
        except BaseException as exc:  # a crashed step: fail everyone rather than hang them
            self.error = exc
            for loop, q in list(self._streams.values()):
                loop.call_soon_threadsafe(q.put_nowait, EngineDeadError(f"engine step failed: {exc!r}"))
            raise
