"""The HTTP process's side of the engine-core process: the AsyncEngine interface (generate,
abort, stats_snapshot, step_page, start/stop_profile, alive, error, info, tokenizer) over a
multiprocessing Pipe to a spawned child that loads the model and steps (``core_process.py``).

Two threads own the pipe: a sender (the event loop never blocks on a full pipe while the child
is inside a long step) and a reader that hands outputs to each request's asyncio.Queue and
answers calls. The reader also watches the child's process sentinel: when the child dies, every
in-flight request and call fails with EngineDeadError at once and ``alive`` turns False.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import multiprocessing
import multiprocessing.connection
import os
import queue
import threading
from contextlib import aclosing
from typing import AsyncIterator

from .async_engine import EngineDeadError
from .core_process import run_engine_core
from .info import EngineInfo
from .output_deltas import DeltaDecoder
from .outputs import RequestOutput
from .process_exit import describe_exit
from .request_batches import add_slices
from .sampling_params import SamplingParams
from .serving_engine import merged_outputs, request_outputs


class EngineCoreClient:
    def __init__(self, model: str | os.PathLike, **engine_args):
        """Spawn the engine process and wait until its model is loaded (errors while loading,
        such as a bad engine argument, are raised here as the child raised them)."""
        if not isinstance(model, (str, os.PathLike)):
            raise TypeError("the engine process loads the model itself: give a preset name, checkpoint folder "
                            f"or .gguf path, not {type(model).__name__}")
        ctx = multiprocessing.get_context("spawn")
        self._conn, child_conn = ctx.Pipe()
        self._proc = ctx.Process(target=run_engine_core, args=(str(model), engine_args, child_conn),
                                 name="flashlane-engine-core", daemon=True)
        self._proc.start()
        child_conn.close()  # the child holds the only other end: its death is an EOF here
        self.info, self.tokenizer = self._wait_ready()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._calls: dict[int, concurrent.futures.Future] = {}
        self._call_ids = itertools.count()
        self._lock = threading.Lock()     # streams/calls against the death fan-out
        self._outbox: queue.Queue = queue.Queue()
        self._deltas = DeltaDecoder()       # used by the reader thread only
        self._threads: list[threading.Thread] = []
        self._closing = False
        self._last_snapshot: dict = {}
        self.error: BaseException | None = None
        self.traceback: str | None = None     # the child's, when a step crashed
        self.exited = threading.Event()       # set once everything in flight has been failed

    @property
    def pid(self) -> int | None:
        return self._proc.pid

    @property
    def exitcode(self) -> int | None:
        return self._proc.exitcode

    def _wait_ready(self) -> tuple[EngineInfo, object]:
        while True:
            ready = multiprocessing.connection.wait([self._conn, self._proc.sentinel])
            if self._conn not in ready:
                break
            try:
                msg = self._conn.recv()
            except EOFError:
                break
            if msg[0] == "ready":
                return msg[1], msg[2]
            if msg[0] == "failed":
                self._proc.join(10)
                raise msg[1]
        self._proc.join(10)
        raise RuntimeError(f"the engine process exited while loading the model ({describe_exit(self._proc.exitcode)})")

    # ---- lifecycle ---------------------------------------------------------------------------
    def start(self) -> None:
        if self._threads:
            return
        self._threads = [threading.Thread(target=self._read_loop, name="flashlane-core-reader", daemon=True),
                         threading.Thread(target=self._send_loop, name="flashlane-core-sender", daemon=True)]
        for t in self._threads:
            t.start()

    def shutdown(self, timeout: float = 10.0) -> None:
        """Fail every in-flight request with finish_reason 'abort', stop the engine process."""
        if self.alive:
            try:
                self._call("abort_all").result(timeout)
            except (EngineDeadError, concurrent.futures.TimeoutError):
                pass
        self._closing = True
        if self._threads:
            self._outbox.put(("stop",))
        else:  # never started: no sender thread to pass it on
            try:
                self._conn.send(("stop",))
            except OSError:
                pass
        self._proc.join(timeout)
        if self._proc.is_alive():
            self._proc.kill()
            self._proc.join(timeout)
        self._outbox.put(None)
        for t in self._threads:
            t.join(timeout)
        self._threads = []
        self._conn.close()

    @property
    def alive(self) -> bool:
        return bool(self._threads) and self.error is None and not self._closing and self._proc.is_alive()

    @property
    def state(self) -> str:
        return "running" if self.alive else "dead"

    # ---- requests ----------------------------------------------------------------------------
    async def generate(self, request_id: str, prompt: str | list[int],
                       params: SamplingParams) -> AsyncIterator[RequestOutput]:
        """As ``AsyncEngine.generate``: a RequestOutput per new token, the last one finished;
        the request is aborted if the consumer goes away."""
        q: asyncio.Queue = asyncio.Queue()
        with self._lock:
            if not self.alive:
                raise EngineDeadError(f"engine is not running: {self.error!r}")
            self._streams[request_id] = (asyncio.get_running_loop(), q)
        try:
            await asyncio.wrap_future(self._call("add", request_id, prompt, params))
        except BaseException as exc:
            self._streams.pop(request_id, None)
            if not isinstance(exc, Exception):  # cancelled while the add may have gone through
                self.abort(request_id)
            raise
        async with aclosing(request_outputs(q, self._streams, request_id, self.abort)) as outs:
            async for out in outs:
                yield out

    async def generate_many(self, requests: list[tuple[str, list[int], SamplingParams]]
                            ) -> AsyncIterator[tuple[int, RequestOutput]]:
        """``generate`` for many ``(request_id, prompt, params)`` at once, their outputs merged as
        ``(index in requests, output)``: submitted in a few "add_many" calls (``add_slices``),
        aborted with one "abort_many" if the consumer goes away before all have finished."""
        q: asyncio.Queue = asyncio.Queue()
        index = {rid: i for i, (rid, _, _) in enumerate(requests)}
        with self._lock:
            if not self.alive:
                raise EngineDeadError(f"engine is not running: {self.error!r}")
            target = (asyncio.get_running_loop(), q)
            for rid in index:
                self._streams[rid] = target
        added: list[str] = []   # request ids whose add went through
        try:
            for part in add_slices(requests):
                call = self._call("add_many", part)
                try:
                    await asyncio.wrap_future(call)
                except BaseException as exc:
                    if not isinstance(exc, Exception):  # cancelled while this add may have gone through
                        added.extend(rid for rid, _, _ in part)
                    raise
                added.extend(rid for rid, _, _ in part)
        except BaseException:
            for rid in index:
                self._streams.pop(rid, None)
            if added:
                self.abort_many(added)
            raise
        async with aclosing(merged_outputs(q, self._streams, index, self.abort_many)) as outs:
            async for item in outs:
                yield item

    def abort(self, request_id: str) -> None:
        if self.alive:
            self._outbox.put(("abort", request_id))

    def abort_many(self, request_ids: list[str]) -> None:
        """Abort these requests with one message; nobody listens to them any more."""
        if self.alive:
            self._outbox.put(("abort_many", list(request_ids)))

    def abort_all(self) -> concurrent.futures.Future:
        """Abort every in-flight request without waiting; each stream gets its final output."""
        return self._call("abort_all")

    async def stats_snapshot(self, timeout: float = 5.0) -> dict:
        """The engine's stats and finish reasons, taken between two steps; the last ones taken
        once the engine process is gone."""
        if not self.alive:
            return dict(self._last_snapshot)
        try:
            snap = await asyncio.wait_for(asyncio.wrap_future(self._call("snapshot")), timeout)
        except EngineDeadError:
            return dict(self._last_snapshot)
        self._last_snapshot = snap
        return dict(snap)

    async def step_page(self, since: float | None, limit: int, with_ids: bool) -> dict:
        return await asyncio.wrap_future(self._call("step_page", since, limit, with_ids))

    async def start_profile(self) -> None:
        """Open a torch.profiler window in the engine process, between two steps."""
        await asyncio.wrap_future(self._call("start_profile"))

    async def stop_profile(self, directory: str) -> dict:
        """Close the window; the engine process writes its trace and summary into ``directory``."""
        return await asyncio.wrap_future(self._call("stop_profile", directory))

    # ---- the pipe ------------------------------------------------------------------------------
    def _call(self, method: str, *args) -> concurrent.futures.Future:
        fut: concurrent.futures.Future = concurrent.futures.Future()
        with self._lock:
            if not self.alive:
                fut.set_exception(EngineDeadError(f"engine is not running: {self.error!r}"))
                return fut
            call_id = next(self._call_ids)
            self._calls[call_id] = fut
        self._outbox.put(("call", call_id, method, args))
        return fut

    def _send_loop(self) -> None:
        while (msg := self._outbox.get()) is not None:
            try:
                self._conn.send(msg)
            except (OSError, ValueError):  # the child is gone; the reader reports it
                return
            if msg[0] == "stop":
                return

    def _read_loop(self) -> None:
        reason = None
        try:
            while reason is None:
                ready = multiprocessing.connection.wait([self._conn, self._proc.sentinel])
                if self._conn in ready:
                    reason = self._receive(self._conn.recv())
                else:
                    reason = "exited"
        except (EOFError, OSError):
            reason = "exited"
        self._proc.join(1)
        self._die(reason if reason != "exited" else
                  f"the engine process exited ({describe_exit(self._proc.exitcode)})")

    def _receive(self, msg) -> str | None:
        """Dispatch one message; a reason string when the child announced its death."""
        kind = msg[0]
        if kind == "outputs":
            for delta in msg[1]:
                out = self._deltas.decode(delta)
                target = None if out is None else self._streams.get(out.request_id)
                if target is not None:
                    _put(target, out)
        elif kind == "reply":
            _, call_id, ok, value = msg
            fut = self._calls.pop(call_id, None)
            if fut is not None and fut.set_running_or_notify_cancel():
                (fut.set_result if ok else fut.set_exception)(value)
        elif kind == "dead":
            self.traceback = msg[2]
            return msg[1]
        return None

    def _die(self, reason: str) -> None:
        """Fail everything in flight; nothing is accepted afterwards."""
        with self._lock:
            if not self._closing:
                self.error = EngineDeadError(reason)
            dead = EngineDeadError(reason)
            streams, self._streams = list(self._streams.values()), {}
            calls, self._calls = list(self._calls.values()), {}
        for target in streams:
            _put(target, dead)
        for fut in calls:
            if fut.set_running_or_notify_cancel():
                fut.set_exception(dead)
        self._outbox.put(None)  # the sender stops too
        self.exited.set()


def _put(target: tuple[asyncio.AbstractEventLoop, asyncio.Queue], item) -> None:
    loop, q = target
    try:
        loop.call_soon_threadsafe(q.put_nowait, item)
    except RuntimeError:  # that event loop is closed: nobody is listening
        pass
