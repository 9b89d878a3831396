"""The HTTP process's side of one engine-core process (``core_process.py``): spawn it, wait
until its model is loaded, then carry messages over the Pipe.

Two threads own the pipe: a sender (the event loop never blocks on a full pipe while the child is
inside a long step) and a reader that hands every message to the receiver. The reader also
watches the child's process sentinel: when the child dies, ``on_death`` is called once with why,
``alive`` turns False and ``exited`` is set.
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.connection
import os
import queue
import threading
from typing import Callable

from .core_process import run_engine_core
from .errors import EngineDeadError
from .info import EngineInfo
from .messages import EngineDied, LoadFailed, Ready, Stop
from .process_exit import describe_exit


class EngineProcess:
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
        self._outbox: queue.SimpleQueue = queue.SimpleQueue()
        self._threads: list[threading.Thread] = []
        self._closing = False
        self.error: BaseException | None = None
        self.traceback: str | None = None     # the child's, when a step crashed
        self.exited = threading.Event()       # set once on_death was called

    @property
    def pid(self) -> int | None:
        return self._proc.pid

    @property
    def exitcode(self) -> int | None:
        return self._proc.exitcode

    @property
    def alive(self) -> bool:
        return bool(self._threads) and self.error is None and not self._closing and self._proc.is_alive()

    def _wait_ready(self) -> tuple[EngineInfo, object]:
        while True:
            ready = multiprocessing.connection.wait([self._conn, self._proc.sentinel])
            if self._conn not in ready:
                break
            try:
                msg = self._conn.recv()
            except EOFError:
                break
            if isinstance(msg, Ready):
                return msg.info, msg.tokenizer
            if isinstance(msg, LoadFailed):
                self._proc.join(10)
                raise msg.error
        self._proc.join(10)
        raise RuntimeError(f"the engine process exited while loading the model ({describe_exit(self._proc.exitcode)})")

    def start(self, on_message: Callable[[object], None], on_death: Callable[[str], None]) -> None:
        self._threads = [
            threading.Thread(target=self._read_loop, args=(on_message, on_death), name="flashlane-core-reader",
                             daemon=True),
            threading.Thread(target=self._send_loop, name="flashlane-core-sender", daemon=True)]
        for t in self._threads:
            t.start()

    def send(self, msg) -> None:
        if self._threads:
            self._outbox.put(msg)

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the engine process (killed if it does not exit within ``timeout``)."""
        self._closing = True
        if self._threads:
            self._outbox.put(Stop())
        else:  # never started: no sender thread to pass it on
            try:
                self._conn.send(Stop())
            except OSError:
                pass
        self._proc.join(timeout)
        if self._proc.is_alive():
            self._proc.kill()
            self._proc.join(timeout)
        self._outbox.put(None)
        for t in self._threads:
            t.join(timeout)
        self._conn.close()

    def _send_loop(self) -> None:
        while (msg := self._outbox.get()) is not None:
            try:
                self._conn.send(msg)
            except (OSError, ValueError):  # the child is gone; the reader reports it
                return
            if isinstance(msg, Stop):
                return

    def _read_loop(self, on_message, on_death) -> None:
        reason = None
        try:
            while reason is None:
                ready = multiprocessing.connection.wait([self._conn, self._proc.sentinel])
                if self._conn not in ready:
                    break
                msg = self._conn.recv()
                if isinstance(msg, EngineDied):
                    self.traceback, reason = msg.traceback, msg.message
                else:
                    on_message(msg)
        except (EOFError, OSError):
            pass
        self._proc.join(1)
        reason = reason or f"the engine process exited ({describe_exit(self._proc.exitcode)})"
        if not self._closing:
            self.error = EngineDeadError(reason)
        self._outbox.put(None)  # the sender stops too
        on_death(reason)
        self.exited.set()
