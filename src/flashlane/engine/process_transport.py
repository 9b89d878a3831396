"""The engine core in an engine process of its own (``engine_process.py``), supervised: when the
process dies, the client is told at once (every request in flight fails with EngineDeadError),
the death is logged (exit status or signal, and the child's traceback when a step crashed), and
another process is started with the same model and engine args, as often and as soon as the
``RestartPolicy`` allows (``restart_policy.py``); then it stays dead. ``max_restarts`` 0: a
death is final.

While the next process loads, ``state`` is "restarting", ``alive`` is False and
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
from typing import Callable

from .engine_process import EngineProcess
from .process_exit import death_report
from .restart_policy import DEFAULT_MAX_RESTARTS, DEFAULT_RESTART_BACKOFF_S, RestartPolicy

log = logging.getLogger("flashlane.engine")


class ProcessTransport:
    def __init__(self, model: str | os.PathLike, *, max_restarts: int = DEFAULT_MAX_RESTARTS,
                 restart_backoff: float = DEFAULT_RESTART_BACKOFF_S, **engine_args):
        """Start the first engine process (its load errors are raised here)."""
        self.policy = RestartPolicy(max_restarts, restart_backoff)   # bad values fail before the load
        self._spawn = functools.partial(EngineProcess, model, **engine_args)
        self._proc, self._load_s = self._timed_spawn()
        self.info, self.tokenizer = self._proc.info, self._proc.tokenizer
        self.restarts = 0
        self.generation = 0
        self._gave_up = False
        self._restarting = False   # a death was handled and the next process is on its way
        self._last_error: BaseException | None = None
        self._resume_at: float | None = None      # monotonic: when the restarting engine should serve
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None
        self._on_message: Callable[[object], None] | None = None
        self._on_death: Callable[[str], None] | None = None

    def _timed_spawn(self) -> tuple[EngineProcess, float]:
        started = time.monotonic()
        proc = self._spawn()
        return proc, time.monotonic() - started

    # ---- lifecycle ---------------------------------------------------------------------------
    def start(self, on_message: Callable[[object], None], on_death: Callable[[str], None]) -> None:
        self._on_message, self._on_death = on_message, on_death
        self._proc.start(on_message, on_death)
        self._thread = threading.Thread(target=self._supervise, name="flashlane-core-supervisor", daemon=True)
        self._thread.start()

    def send(self, msg) -> None:
        self._proc.send(msg)

    def shutdown(self, timeout: float = 10.0) -> None:
        self._stopping.set()
        with self._lock:
            proc = self._proc
        proc.shutdown(timeout)
        if self._thread is not None:
            # a restart still loading shuts its engine down itself when it comes up
            self._thread.join(timeout)

    @property
    def pid(self) -> int | None:
        return self._proc.pid

    @property
    def state(self) -> str:
        """"running"; "restarting" from the death until the next process serves; "dead" once
        the restart limit is reached, and before start / after shutdown."""
        if self._proc.alive:
            return "running"
        if self._thread is None or self._stopping.is_set() or self._gave_up:
            return "dead"
        with self._lock:   # until the supervisor thread handles the death, say what it will decide
            if self._proc.alive:   # a restart finished while we waited for the lock
                return "running"
            return "restarting" if self._restarting or self.policy.may_restart(time.monotonic()) else "dead"

    @property
    def alive(self) -> bool:
        return self.state == "running"

    @property
    def error(self) -> BaseException | None:
        """Why the engine is not serving (its death, or a restart that failed to load)."""
        if self._proc.alive:
            return None
        return self._last_error or self._proc.error

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
            proc = self._proc
            proc.exited.wait()
            if self._stopping.is_set():
                return
            self._bury(proc)
            if not self._restart():
                return

    def _bury(self, proc: EngineProcess) -> None:
        proc.shutdown(timeout=5.0)   # reaps the process (its exit code) and closes the pipe
        self._last_error = proc.error
        log.error("the engine process (pid %s) died: %s", proc.pid,
                  death_report(str(proc.error), proc.exitcode, proc.traceback))

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
                proc, load_s = self._timed_spawn()
            except Exception as exc:
                self._last_error = exc
                log.error("the engine process failed to start again: %r", exc)
                continue
            with self._lock:
                stopped = self._stopping.is_set()
                if not stopped:
                    proc.start(self._on_message, self._on_death)
                    self._proc, self._load_s = proc, load_s
                    self.restarts += 1
                    self.generation += 1
                    self._restarting = False
                    self._last_error = self._resume_at = None
            if stopped:
                proc.shutdown()
                return False
            log.warning("the engine process is serving again (pid %s; restarts so far: %d)", proc.pid, self.restarts)
            return True
