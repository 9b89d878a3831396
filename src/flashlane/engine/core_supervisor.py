"""Supervision of the engine-core process: ``EngineCoreSupervisor`` serves through an
EngineCoreClient and, when that process dies, logs why (exit status or signal, and the child's
traceback when a step crashed) and starts another with the same model and engine args, as
often and as soon as its ``RestartPolicy`` allows (``restart_policy.py``); then it stays dead.

Requests in flight at the death fail with EngineDeadError at once (the client fails them);
while the next process loads, ``state`` is "restarting", ``alive`` is False and
``retry_after`` estimates when it serves again. ``info`` and ``tokenizer`` stay those of the
first start.
"""

from __future__ import annotations

import functools
import logging
import math
import os
import threading
import time
from contextlib import aclosing
from typing import AsyncIterator

from .async_engine import EngineDeadError
from .core_client import EngineCoreClient
from .outputs import RequestOutput
from .process_exit import death_report
from .restart_policy import DEFAULT_MAX_RESTARTS, DEFAULT_RESTART_BACKOFF_S, RestartPolicy
from .sampling_params import SamplingParams

log = logging.getLogger("flashlane.engine")


class EngineCoreSupervisor:
    def __init__(self, model: str | os.PathLike, *, max_restarts: int = DEFAULT_MAX_RESTARTS,
                 restart_backoff: float = DEFAULT_RESTART_BACKOFF_S, **engine_args):
        """Start the first engine process (its load errors are raised here). ``max_restarts``
        0: never restart (a death is final, as with a bare EngineCoreClient)."""
        self.policy = RestartPolicy(max_restarts, restart_backoff)   # bad values fail before the load
        self._spawn = functools.partial(EngineCoreClient, model, **engine_args)
        self._client, self._load_s = self._timed_spawn()
        self.info, self.tokenizer = self._client.info, self._client.tokenizer
        self.restarts = 0
        self._gave_up = False
        self._restarting = False   # a death was handled and the next process is on its way
        self._last_error: BaseException | None = None
        self._resume_at: float | None = None      # monotonic: when the restarting engine should serve
        self._profiled: EngineCoreClient | None = None   # the client a profiling window is open on
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None

    def _timed_spawn(self) -> tuple[EngineCoreClient, float]:
        started = time.monotonic()
        client = self._spawn()
        return client, time.monotonic() - started

    # ---- lifecycle ---------------------------------------------------------------------------
    def start(self) -> None:
        if self._thread is None:
            self._client.start()
            self._thread = threading.Thread(target=self._supervise, name="flashlane-core-supervisor", daemon=True)
            self._thread.start()

    def shutdown(self, timeout: float = 10.0) -> None:
        self._stopping.set()
        with self._lock:
            client = self._client
        client.shutdown(timeout)
        if self._thread is not None:
            # a restart still loading shuts its engine down itself when it comes up
            self._thread.join(timeout)

    @property
    def pid(self) -> int | None:
        return self._client.pid

    @property
    def state(self) -> str:
        """"running"; "restarting" from the death until the next process serves; "dead" once
        the restart limit is reached, and before start / after shutdown."""
        if self._client.alive:
            return "running"
        if self._thread is None or self._stopping.is_set() or self._gave_up:
            return "dead"
        with self._lock:   # until the supervisor thread handles the death, say what it will decide
            return "restarting" if self._restarting or self.policy.may_restart(time.monotonic()) else "dead"

    @property
    def alive(self) -> bool:
        return self.state == "running"

    @property
    def error(self) -> BaseException | None:
        """Why the engine is not serving (its death, or a restart that failed to load)."""
        if self._client.alive:
            return None
        return self._last_error or self._client.error

    @property
    def retry_after(self) -> int | None:
        """Seconds until a restarting engine should serve again (the backoff left plus the time
        the last start took to load), at least 1; None unless restarting."""
        if self.state != "restarting":
            return None
        resume_at = self._resume_at
        if resume_at is None:   # the death is not handled yet
            with self._lock:
                eta = self.policy.backoff(time.monotonic()) + self._load_s
        else:
            eta = resume_at - time.monotonic()
        return max(1, math.ceil(eta))

    # ---- restarting --------------------------------------------------------------------------
    def _supervise(self) -> None:
        while True:
            client = self._client
            client.exited.wait()
            if self._stopping.is_set():
                return
            self._bury(client)
            if not self._restart():
                return

    def _bury(self, client: EngineCoreClient) -> None:
        client.shutdown(timeout=5.0)   # reaps the process (its exit code) and closes the pipe
        self._last_error = client.error
        log.error("the engine process (pid %s) died: %s", client.pid,
                  death_report(str(client.error), client.exitcode, client.traceback))

    def _restart(self) -> bool:
        """Start engine processes until one serves (True), or the limit is reached or the
        server stops (False)."""
        while True:
            policy = self.policy
            with self._lock:
                now = time.monotonic()
                self._gave_up = not policy.may_restart(now)
                self._restarting = not self._gave_up
                delay, tried = policy.backoff(now), policy.recent(now)
            if self._gave_up:
                log.error("not restarting the engine process: %s; /health reports the error until the server "
                          "is restarted", "restarts are off (--engine-restarts 0)" if not policy.max_restarts else
                          f"the restart limit is spent ({tried} within {policy.window_s:.0f} s, "
                          f"--engine-restarts {policy.max_restarts})")
                return False
            self._resume_at = time.monotonic() + delay + self._load_s
            log.warning("restarting the engine process in %.3g s (restart %d of at most %d within %.0f s)",
                        delay, tried + 1, policy.max_restarts, policy.window_s)
            if self._stopping.wait(delay):
                return False
            with self._lock:
                policy.record(time.monotonic())
            try:
                client, load_s = self._timed_spawn()
                client.start()
            except Exception as exc:
                self._last_error = exc
                log.error("the engine process failed to start again: %r", exc)
                continue
            with self._lock:
                stopped = self._stopping.is_set()
                if not stopped:
                    self._client, self._load_s = client, load_s
                    self.restarts += 1
                    self._restarting = False
                    self._last_error = self._resume_at = None
            if stopped:
                client.shutdown()
                return False
            log.warning("the engine process is serving again (pid %s; restarts so far: %d)", client.pid, self.restarts)
            return True

    # ---- requests ----------------------------------------------------------------------------
    async def generate(self, request_id: str, prompt: str | list[int],
                       params: SamplingParams) -> AsyncIterator[RequestOutput]:
        async with aclosing(self._client.generate(request_id, prompt, params)) as outs:
            async for out in outs:
                yield out

    async def generate_many(self, requests: list[tuple[str, list[int], SamplingParams]]
                            ) -> AsyncIterator[tuple[int, RequestOutput]]:
        async with aclosing(self._client.generate_many(requests)) as outs:
            async for item in outs:
                yield item

    def abort(self, request_id: str) -> None:
        self._client.abort(request_id)

    def abort_many(self, request_ids: list[str]) -> None:
        self._client.abort_many(request_ids)

    def abort_all(self) -> object:
        return self._client.abort_all()

    async def stats_snapshot(self, timeout: float = 5.0) -> dict:
        """The engine's snapshot (the last one taken while it is down) with ``engine_state``
        and ``engine_restarts``."""
        snap = await self._client.stats_snapshot(timeout)
        return {**snap, "engine_state": self.state, "engine_restarts": self.restarts}

    async def step_page(self, since: float | None, limit: int, with_ids: bool) -> dict:
        return await self._client.step_page(since, limit, with_ids)

    async def start_profile(self) -> None:
        client = self._client
        await client.start_profile()
        self._profiled = client

    async def stop_profile(self, directory: str) -> dict:
        client, opened_on = self._client, self._profiled
        self._profiled = None
        if opened_on is not None and opened_on is not client:
            raise EngineDeadError("the engine process the profiling window was open in died (another serves now): "
                                  "POST /start_profile to open a new window")
        return await client.stop_profile(directory)
