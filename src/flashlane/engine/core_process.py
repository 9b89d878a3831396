"""The engine-core process: loads the model itself, owns the torch/OpenMP threads, schedules and
steps; the HTTP process talks to it over one multiprocessing Pipe (``core_client.py``).

Messages (pickled tuples), parent -> child:
  ("call", call_id, method, args)   answered by ("reply", call_id, ok, value or exception)
  ("abort", request_id)             fire and forget (its final output is sent like any other)
  ("abort_many", [request_id, ...]) fire and forget; the parent stopped listening to them, so only
                                    requests that already sent an output send their last one
  ("stop",)                         close the engine and exit
child -> parent:
  ("ready", EngineInfo, tokenizer)  once, after the model loaded (or ("failed", exception))
  ("outputs", [delta, ...])         after every step that produced any (``output_deltas.py``)
  ("dead", message, traceback)      a step crashed (the formatted traceback); the process exits
                                    right after

The child ignores SIGINT (Ctrl-C reaches the whole process group; the HTTP process decides how
to shut down) and exits when the pipe closes, so it never outlives its server.
"""

from __future__ import annotations

import pickle
import signal
import traceback

from ..kernels.profiling import profiling_range
from .llm_engine import LLMEngine
from .output_deltas import DeltaEncoder
from .profiling import StepProfiler, write_window
from .request_batches import abort_each, add_all
from .threads import default_threads, usable_cpus

OUTPUT_SLICE_IDS = 1 << 20   # prompt ids per outputs message (first outputs carry their prompt)


class _Core:
    """The methods the parent may call, run between two steps."""

    def __init__(self, engine: LLMEngine, conn):
        self.engine = engine
        self.conn = conn
        self.profile = StepProfiler()
        self.deltas = DeltaEncoder()

    def send_outputs(self, outputs) -> None:
        """In messages of about OUTPUT_SLICE_IDS prompt ids at most: the parent unpickles each
        one holding its GIL."""
        batch, ids = [], 0
        for out in outputs:
            delta = self.deltas.encode(out)
            batch.append(delta)
            ids += len(out.prompt_token_ids) if delta[1] is not None else 0
            if ids >= OUTPUT_SLICE_IDS:
                self.conn.send(("outputs", batch))
                batch, ids = [], 0
        if batch:
            self.conn.send(("outputs", batch))

    def abort(self, request_id: str) -> None:
        out = self.engine.abort(request_id)
        if out is not None:
            self.send_outputs([out])

    def add(self, request_id: str, prompt, params) -> None:
        self.engine.add_request(request_id, prompt, params)

    def add_many(self, requests: list[tuple]) -> None:
        add_all(self.engine, requests)

    def abort_many(self, request_ids: list[str]) -> None:
        outs = abort_each(self.engine, request_ids)
        self.send_outputs([out for out in outs if self.deltas.started(out.request_id)])

    def abort_all(self) -> None:
        self.send_outputs(abort_each(self.engine, list(self.engine.requests)))

    def snapshot(self) -> dict:
        return self.engine.snapshot()

    def step_page(self, since, limit: int, with_ids: bool) -> dict:
        return self.engine.step_stats.page(since, limit, with_ids)

    def start_profile(self) -> None:
        self.profile.start()

    def stop_profile(self, directory: str) -> dict:
        return write_window(self.profile.stop(), directory)


def _sendable(exc: Exception) -> Exception:
    """``exc`` itself when it survives pickling (its type and message reach the caller), else a
    RuntimeError with its text."""
    try:
        pickle.loads(pickle.dumps(exc))
        return exc
    except Exception:
        return RuntimeError(f"{type(exc).__name__}: {exc}")


def _handle(core: _Core, msg) -> bool:
    """Run one command; False when the parent asked the process to stop."""
    kind = msg[0]
    if kind == "abort":
        core.abort(msg[1])
    elif kind == "abort_many":
        core.abort_many(msg[1])
    elif kind == "call":
        _, call_id, method, args = msg
        try:
            reply = (call_id, True, getattr(core, method)(*args))
        except Exception as exc:  # reported to the caller; the engine keeps going
            reply = (call_id, False, _sendable(exc))
        core.conn.send(("reply", *reply))
    elif kind == "stop":
        return False
    return True


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
        conn.send(("failed", _sendable(exc)))
        return
    conn.send(("ready", engine.info, engine.tokenizer))
    core = _Core(engine, conn)
    try:
        running = True
        while running:
            # commands first (as the in-process stepping thread does); block only when idle
            while running and conn.poll(0 if engine.has_unfinished() else None):
                running = _handle(core, conn.recv())
            if running and engine.has_unfinished():
                with profiling_range("engine_step"):
                    outputs = engine.step()
                core.send_outputs(outputs)
    except (EOFError, BrokenPipeError, ConnectionResetError):
        pass  # the HTTP process is gone: nobody left to serve
    except BaseException as exc:
        try:
            conn.send(("dead", f"engine step failed: {exc!r}", traceback.format_exc()))
        finally:
            raise
    finally:
        engine.close()
