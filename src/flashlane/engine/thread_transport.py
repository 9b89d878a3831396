"""The engine core on a thread of this process: messages in through a queue, out by calling the
client's receiver on the stepping thread. Nothing is pickled; a crashed step is final (a thread
cannot be restarted: ``state`` turns "dead")."""

from __future__ import annotations

import queue
import threading
from typing import Callable, Iterable

from .core import EngineCore, run_core_loop
from .llm_engine import LLMEngine
from .messages import Stop


class QueueInbox:
    def __init__(self):
        self._q: queue.SimpleQueue = queue.SimpleQueue()

    def put(self, msg) -> None:
        self._q.put(msg)

    def take(self, wait: bool) -> Iterable[object]:
        msgs = [self._q.get()] if wait else []
        while True:
            try:
                msgs.append(self._q.get_nowait())
            except queue.Empty:
                return msgs


class ThreadTransport:
    restarts = 0
    generation = 0
    retry_after = None

    def __init__(self, model, **engine_args):
        """``model``: a preset name, checkpoint folder, .gguf path, or a loaded model."""
        self.engine = LLMEngine(model, **engine_args)
        self.info, self.tokenizer = self.engine.info, self.engine.tokenizer
        self._inbox = QueueInbox()
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self._error is None

    @property
    def state(self) -> str:
        return "running" if self.alive else "dead"

    @property
    def error(self) -> BaseException | None:
        return self._error

    def start(self, on_message: Callable[[object], None], on_death: Callable[[str], None]) -> None:
        def loop() -> None:
            try:
                run_core_loop(EngineCore(self.engine), self._inbox, on_message)
            except BaseException as exc:  # a crashed step: fail everyone rather than hang them
                self._error = exc
                on_death(f"engine step failed: {exc!r}")
                raise

        self._thread = threading.Thread(target=loop, name="flashlane-engine", daemon=True)
        self._thread.start()

    def send(self, msg) -> None:
        self._inbox.put(msg)

    def shutdown(self, timeout: float) -> None:
        if self._thread is not None:
            self._inbox.put(Stop())
            self._thread.join(timeout)
            self._thread = None
        self.engine.close()
