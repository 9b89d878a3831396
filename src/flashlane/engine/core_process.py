"""The engine-core process: loads the model itself, owns the torch/OpenMP threads and runs the
step loop (``core.run_core_loop``) on messages from one multiprocessing Pipe (``messages.py``;
the parent's side is ``engine_process.py``). It sends ``Ready`` (or ``LoadFailed``) once, then
``StepOutputs`` and ``Reply`` messages, and ``EngineDied`` if a step crashes.

The child ignores SIGINT (Ctrl-C reaches the whole process group; the HTTP process decides how
to shut down) and exits when the pipe closes, so it never outlives its server.
"""

from __future__ import annotations

import pickle
import signal
import traceback
from typing import Iterable

from .core import EngineCore, run_core_loop
from .llm_engine import LLMEngine
from .messages import EngineDied, LoadFailed, Ready, Reply
from .threads import default_threads, usable_cpus


class PipeInbox:
    def __init__(self, conn):
        self._conn = conn

    def take(self, wait: bool) -> Iterable[object]:
        msgs = []
        if wait or self._conn.poll(0):
            msgs.append(self._conn.recv())
        while self._conn.poll(0):
            msgs.append(self._conn.recv())
        return msgs


def _sendable(exc: BaseException) -> BaseException:
    """``exc`` itself when it survives pickling (its type and message reach the caller), else a
    RuntimeError with its text."""
    try:
        pickle.loads(pickle.dumps(exc))
        return exc
    except Exception:
        return RuntimeError(f"{type(exc).__name__}: {exc}")


def default_engine_threads() -> int:
    """Torch threads of an engine process not told how many (started outside the CLI, which
    chooses them by ``threads.choose_threads``): every CPU this process may use but one, which
    the HTTP process keeps (measured on 2 cores: with both cores in the engine's OpenMP pool,
    32 concurrent streams took ~7x longer than with one)."""
    return default_threads(len(usable_cpus()), busy=None)


def run_engine_core(model: str, engine_args: dict, conn) -> None:
    """The child's main function (multiprocessing spawn target)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if engine_args.get("num_threads") is None:
        engine_args = {**engine_args, "num_threads": default_engine_threads()}
    try:
        engine = LLMEngine(model, **engine_args)
    except Exception as exc:
        conn.send(LoadFailed(_sendable(exc)))
        return
    conn.send(Ready(engine.info, engine.tokenizer))

    def emit(msg) -> None:
        if isinstance(msg, Reply) and msg.error is not None:
            msg.error = _sendable(msg.error)
        conn.send(msg)

    try:
        run_core_loop(EngineCore(engine), PipeInbox(conn), emit)
    except (EOFError, BrokenPipeError, ConnectionResetError):
        pass  # the HTTP process is gone: nobody left to serve
    except BaseException as exc:
        try:
            conn.send(EngineDied(f"engine step failed: {exc!r}", traceback.format_exc()))
        finally:
            raise
    finally:
        engine.close()
