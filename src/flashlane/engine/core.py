"""The engine core: an LLMEngine, the commands a client may send it, and the one step loop.

Whatever carries the messages (a queue to a thread of this process, ``thread_transport.py``, or
a pipe to an engine process, ``core_process.py``), the loop is the same: run the commands that
arrived (blocking only while the engine has nothing to do), then one step, whose deltas go out
as one ``StepOutputs``.
"""

from __future__ import annotations

from typing import Callable, Iterable, Protocol

from ..trace_ranges import profiling_range
from .llm_engine import LLMEngine
from .messages import (AbortAll, AbortRequests, AddRequests, Call, Reply, StartProfile, StepOutputs, StepPage,
                       Stop, StopProfile, TakeSnapshot)
from .outputs import RequestDelta
from .profiling import StepProfiler, write_window


class Inbox(Protocol):
    def take(self, wait: bool) -> Iterable[object]:
        """The messages that arrived; with ``wait``, block until at least one does."""


class EngineCore:
    def __init__(self, engine: LLMEngine):
        self.engine = engine
        self.profile = StepProfiler()
        self._commands = {AddRequests: self._add, AbortAll: self._abort_all, TakeSnapshot: self._snapshot,
                          StepPage: self._step_page, StartProfile: self._start_profile,
                          StopProfile: self._stop_profile}

    @property
    def has_work(self) -> bool:
        return self.engine.has_unfinished()

    def handle(self, msg, emit: Callable[[object], None]) -> bool:
        """Run one message (its reply and any final deltas go to ``emit``); False on ``Stop``."""
        if isinstance(msg, AbortRequests):
            self._emit_deltas(self._abort(msg.request_ids, msg.reason), emit)
        elif isinstance(msg, Call):
            deltas: list[RequestDelta] = []
            try:
                reply = Reply(msg.call_id, value=self._commands[type(msg.command)](msg.command, deltas))
            except Exception as exc:  # reported to the caller; the engine keeps going
                reply = Reply(msg.call_id, error=exc)
            self._emit_deltas(deltas, emit)
            emit(reply)
        elif isinstance(msg, Stop):
            return False
        else:
            raise TypeError(f"the engine core got a {type(msg).__name__}, which is not a message for it")
        return True

    def step(self, emit: Callable[[object], None]) -> None:
        with profiling_range("engine_step"):
            deltas = self.engine.step()
        self._emit_deltas(deltas, emit)

    @staticmethod
    def _emit_deltas(deltas: list[RequestDelta], emit) -> None:
        if deltas:
            emit(StepOutputs(deltas))

    # ---- commands ----------------------------------------------------------------------------
    def _add(self, cmd: AddRequests, deltas: list) -> None:
        added = []
        try:
            for r in cmd.requests:
                self.engine.add_request(r.request_id, r.prompt_token_ids, r.params, r.arrival_time)
                added.append(r.request_id)
        except Exception:
            self._abort(added, "abort")   # nobody waits for their outputs: none is emitted
            raise

    def _abort(self, request_ids: list[str], reason: str) -> list[RequestDelta]:
        return [d for rid in request_ids if (d := self.engine.abort(rid, reason)) is not None]

    def _abort_all(self, cmd: AbortAll, deltas: list) -> None:
        deltas.extend(self._abort(list(self.engine.requests), "abort"))

    def _snapshot(self, cmd: TakeSnapshot, deltas: list) -> dict:
        return self.engine.snapshot()

    def _step_page(self, cmd: StepPage, deltas: list) -> dict:
        return self.engine.step_stats.page(cmd.since, cmd.limit, cmd.with_ids)

    def _start_profile(self, cmd: StartProfile, deltas: list) -> None:
        self.profile.start()

    def _stop_profile(self, cmd: StopProfile, deltas: list) -> dict:
        return write_window(self.profile.stop(), cmd.directory)


def run_core_loop(core: EngineCore, inbox: Inbox, emit: Callable[[object], None]) -> None:
    """The step loop: until a ``Stop`` arrives. A step that raises propagates (the transport
    reports the death)."""
    while True:
        # the messages and the step's deltas are not kept past their turn: a loop variable would
        # hold the last batch of prompts alive until the next one arrives
        if not _run_messages(core, inbox.take(wait=not core.has_work), emit):
            return
        if core.has_work:
            core.step(emit)


def _run_messages(core: EngineCore, messages: Iterable[object], emit) -> bool:
    for msg in messages:
        if not core.handle(msg, emit):
            return False
    return True
