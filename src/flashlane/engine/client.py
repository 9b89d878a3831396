"""The one engine client: what the HTTP server (and any asyncio caller) uses to run requests on an
engine core, over either transport (``thread_transport.py``: a thread of this process;
``process_transport.py``: an engine process of its own, restarted when it dies).

The core sends token deltas; the client's ``OutputProcessor`` turns them into RequestOutputs
(text, stop strings, accumulation) on the transport's receiving thread, and hands each to its
request's asyncio.Queue on the caller's event loop. A stop string found here aborts the engine
request (finish reason "stop"). However a consumer leaves, its requests are aborted.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import threading
import time
from contextlib import aclosing
from typing import AsyncIterator, Callable, Protocol

from .errors import EngineDeadError
from .info import EngineInfo
from .messages import (AbortAll, AbortRequests, AddRequests, Call, Command, NewRequest, Reply, StartProfile,
                       StepOutputs, StepPage, StopProfile, TakeSnapshot)
from .output_processor import OutputProcessor
from .request_check import InvalidRequest
from .outputs import RequestOutput
from .sampling_params import SamplingParams

MERGED_BURST = 64   # outputs handed on before the consumer yields to the event loop once
ADD_SLICE_IDS = 1 << 20   # prompt token ids per add message: pickling 1 M ids holds the GIL ~20 ms


class Transport(Protocol):
    info: EngineInfo
    tokenizer: object           # a models.tokenizer.Tokenizer, or None (token ids only)
    restarts: int               # engine processes started again after a death
    generation: int             # which engine serves: changes with each restart

    @property
    def alive(self) -> bool: ...

    @property
    def state(self) -> str: ...   # "running", "restarting" (a supervised engine process) or "dead"

    @property
    def error(self) -> BaseException | None: ...

    @property
    def retry_after(self) -> int | None: ...

    def start(self, on_message: Callable[[object], None], on_death: Callable[[str], None]) -> None: ...

    def send(self, msg) -> None: ...

    def shutdown(self, timeout: float) -> None: ...


class EngineClient:
    def __init__(self, transport: Transport):
        self.transport = transport
        self._processor = OutputProcessor(transport.tokenizer)
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._calls: dict[int, concurrent.futures.Future] = {}
        self._call_ids = itertools.count()
        self._lock = threading.Lock()    # streams, calls and the processor: event loop vs receiving thread
        self._last_snapshot: dict = {}
        self._profiled: int | None = None   # the transport generation a profiling window is open on
        self._started = False

    # ---- what the engine is ------------------------------------------------------------------
    @property
    def info(self) -> EngineInfo:
        return self.transport.info

    @property
    def tokenizer(self):
        return self.transport.tokenizer

    @property
    def alive(self) -> bool:
        return self._started and self.transport.alive

    @property
    def state(self) -> str:
        return self.transport.state if self._started else "dead"

    @property
    def error(self) -> BaseException | None:
        return self.transport.error

    @property
    def retry_after(self) -> int | None:
        return self.transport.retry_after

    # ---- lifecycle ---------------------------------------------------------------------------
    def start(self) -> None:
        if not self._started:
            self._started = True
            self.transport.start(self._receive, self._die)

    def shutdown(self, timeout: float = 10.0) -> None:
        """Fail every in-flight request with finish_reason 'abort', then stop the engine."""
        if self.alive:
            try:
                self._call(AbortAll()).result(timeout)
            except (EngineDeadError, concurrent.futures.TimeoutError):
                pass
        self.transport.shutdown(timeout)
        self._die("the engine was shut down")

    # ---- requests ----------------------------------------------------------------------------
    async def generate(self, request_id: str, prompt: str | list[int],
                       params: SamplingParams) -> AsyncIterator[RequestOutput]:
        """The request's outputs (as ``params.output_kind`` says), the last one finished."""
        async with aclosing(self.generate_many([(request_id, prompt, params)])) as outs:
            async for _, out in outs:
                yield out

    async def generate_many(self, requests: list[tuple[str, str | list[int], SamplingParams]]
                            ) -> AsyncIterator[tuple[int, RequestOutput]]:
        """Many ``(request_id, prompt, params)`` at once, their outputs merged as ``(index in
        requests, output)``: added all or none (in a few messages, ``add_slices``), and those
        not finished are aborted together if the consumer goes away."""
        q: asyncio.Queue = asyncio.Queue()
        index = {rid: i for i, (rid, _, _) in enumerate(requests)}
        new = self._register(requests, (asyncio.get_running_loop(), q))
        added: list[str] = []
        try:
            for part in add_slices(new):
                call = self._call(AddRequests(part))
                try:
                    await asyncio.wrap_future(call)
                except BaseException as exc:
                    if not isinstance(exc, Exception):   # cancelled while this add may have gone through
                        added.extend(r.request_id for r in part)
                    raise
                added.extend(r.request_id for r in part)
        except BaseException:
            self._forget(list(index))
            if added:
                self._send_abort(added)
            raise
        async with aclosing(self._merged(q, index)) as outs:
            async for item in outs:
                yield item

    def abort(self, request_id: str) -> None:
        self.abort_many([request_id])

    def abort_many(self, request_ids: list[str]) -> None:
        """Abort these requests; nobody listens to them any more."""
        self._forget(request_ids)
        self._send_abort(request_ids)

    def abort_all(self) -> concurrent.futures.Future:
        """Abort every request in the engine without waiting; each stream gets its final output."""
        return self._call(AbortAll())

    # ---- engine state --------------------------------------------------------------------------
    async def stats_snapshot(self, timeout: float = 5.0) -> dict:
        """The engine's stats and finish reasons, taken between two steps (the last ones taken
        while it is not running), with ``engine_state`` and ``engine_restarts``."""
        if self.alive:
            try:
                self._last_snapshot = await asyncio.wait_for(asyncio.wrap_future(self._call(TakeSnapshot())), timeout)
            except EngineDeadError:
                pass
        return {**self._last_snapshot, "engine_state": self.state, "engine_restarts": self.transport.restarts}

    async def step_page(self, since: float | None, limit: int, with_ids: bool) -> dict:
        """A page of the engine's step log (``StepLog.page``)."""
        return await asyncio.wrap_future(self._call(StepPage(since, limit, with_ids)))

    async def start_profile(self) -> None:
        """Open a torch.profiler window on the engine's stepping thread, between two steps."""
        generation = self.transport.generation
        await asyncio.wrap_future(self._call(StartProfile()))
        self._profiled = generation

    async def stop_profile(self, directory: str) -> dict:
        """Close the window; the engine writes its trace and summary into ``directory``."""
        opened_on, self._profiled = self._profiled, None
        if opened_on is not None and opened_on != self.transport.generation:
            raise EngineDeadError("the engine process the profiling window was open in died (another serves now): "
                                  "POST /start_profile to open a new window")
        return await asyncio.wrap_future(self._call(StopProfile(directory)))

    # ---- the caller's side -----------------------------------------------------------------------
    def _register(self, requests, target) -> list[NewRequest]:
        arrival = time.monotonic()
        new = []
        for rid, prompt, params in requests:
            text = prompt if isinstance(prompt, str) else None
            ids = self._encode(prompt) if text is not None else prompt
            new.append(NewRequest(rid, ids, params, arrival))
        ids = [r.request_id for r in new]
        with self._lock:
            if not self.alive:
                raise EngineDeadError(f"engine is not running: {self.error!r}")
            taken = next((rid for rid in ids if rid in self._streams), None)
            if taken is not None or len(set(ids)) < len(ids):
                dup = taken if taken is not None else next(rid for rid in ids if ids.count(rid) > 1)
                raise InvalidRequest(f"request id {dup!r} is already in use", "request_id")
            for r, (_, prompt, _) in zip(new, requests):
                self._processor.add(r.request_id, r.prompt_token_ids, r.params, arrival,
                                    prompt if isinstance(prompt, str) else None)
                self._streams[r.request_id] = target
        return new

    def _encode(self, text: str) -> list[int]:
        if self.tokenizer is None:
            raise ValueError("this engine has no tokenizer (skip_tokenizer_init=True, or a checkpoint without "
                             "tokenizer.json): give prompts as lists of token ids")
        return self.tokenizer.encode(text)

    async def _merged(self, q: asyncio.Queue, index: dict[str, int]) -> AsyncIterator[tuple[int, RequestOutput]]:
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
            self._forget(list(index))
            if left:
                self._send_abort(list(left))

    def _forget(self, request_ids: list[str]) -> None:
        with self._lock:
            for rid in request_ids:
                self._streams.pop(rid, None)
                self._processor.remove(rid)

    def _send_abort(self, request_ids: list[str], reason: str = "abort") -> None:
        if self.alive:
            self.transport.send(AbortRequests(list(request_ids), reason))

    def _call(self, command: Command) -> concurrent.futures.Future:
        fut: concurrent.futures.Future = concurrent.futures.Future()
        with self._lock:
            if not self.alive:
                fut.set_exception(EngineDeadError(f"engine is not running: {self.error!r}"))
                return fut
            call_id = next(self._call_ids)
            self._calls[call_id] = fut
        self.transport.send(Call(call_id, command))
        return fut

    # ---- the transport's receiving thread --------------------------------------------------------
    def _receive(self, msg) -> None:
        if isinstance(msg, StepOutputs):
            self._deliver(msg)
        elif isinstance(msg, Reply):
            with self._lock:
                fut = self._calls.pop(msg.call_id, None)
            if fut is not None and fut.set_running_or_notify_cancel():
                if msg.error is None:
                    fut.set_result(msg.value)
                else:
                    fut.set_exception(msg.error)

    def _deliver(self, msg: StepOutputs) -> None:
        stopped = []
        with self._lock:
            for delta in msg.deltas:
                processed = self._processor.process(delta)
                if processed.output is None:
                    continue
                if processed.stopped:
                    stopped.append(delta.request_id)
                target = self._streams.get(delta.request_id)
                if target is not None:
                    _put(target, processed.output)
        if stopped:
            self._send_abort(stopped, "stop")

    def _die(self, reason: str) -> None:
        """The engine stopped: fail everything in flight (a restarted engine starts clean)."""
        dead = EngineDeadError(reason)
        with self._lock:
            streams, self._streams = list(self._streams.values()), {}
            calls, self._calls = list(self._calls.values()), {}
            self._processor = OutputProcessor(self.transport.tokenizer)
        for target in {id(t): t for t in streams}.values():
            _put(target, dead)
        for fut in calls:
            if fut.set_running_or_notify_cancel():
                fut.set_exception(dead)


def _put(target: tuple[asyncio.AbstractEventLoop, asyncio.Queue], item) -> None:
    loop, q = target
    try:
        loop.call_soon_threadsafe(q.put_nowait, item)
    except RuntimeError:  # that event loop is closed: nobody is listening
        pass


def add_slices(requests: list[NewRequest]) -> list[list[NewRequest]]:
    """``requests`` in consecutive slices of at most ADD_SLICE_IDS prompt ids (at least one
    request each), so no single message is slow to pickle."""
    slices, current, ids = [], [], 0
    for req in requests:
        size = len(req.prompt_token_ids)
        if current and ids + size > ADD_SLICE_IDS:
            slices.append(current)
            current, ids = [], 0
        current.append(req)
        ids += size
    if current:
        slices.append(current)
    return slices
