"""The disk tier's loader: one daemon thread working through a queue of loads.

A read can block forever (a hung network filesystem, a device); then the thread is abandoned,
not joined: ``replace`` hands the queued loads to a fresh loader and tells the old thread to
exit if it ever returns. Daemon threads, not a ThreadPoolExecutor, whose workers are joined at
interpreter exit, so a stuck read would hang shutdown.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from typing import Callable

log = logging.getLogger("flashlane.cache")

_STOP = object()


class DiskLoader:
    def __init__(self, work: Callable[[object], None]):
        self._work = work
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._busy_since: float | None = None
        self._thread = threading.Thread(target=self._run, name="flashlane-cache-load", daemon=True)
        self._thread.start()

    def submit(self, job: object) -> None:
        self._jobs.put(job)

    @property
    def busy_since(self) -> float | None:
        """When the job in hand started (None: idle)."""
        return self._busy_since

    def stuck(self, deadline_s: float, now: float) -> bool:
        """True when the job in hand has run longer than ``deadline_s``."""
        since = self._busy_since
        return since is not None and now - since > deadline_s

    def replace(self) -> "DiskLoader":
        """A fresh loader with this one's queued jobs; this one's thread exits when it returns."""
        fresh = DiskLoader(self._work)
        while True:
            try:
                job = self._jobs.get_nowait()
            except queue.Empty:
                break
            if job is not _STOP:
                fresh.submit(job)
        self._jobs.put(_STOP)
        return fresh

    def stop(self, timeout_s: float) -> bool:
        """Ask the thread to finish its queue and exit; False when it is still busy after the wait."""
        self._jobs.put(_STOP)
        self._thread.join(timeout_s)
        return not self._thread.is_alive()

    def _run(self) -> None:
        while (job := self._jobs.get()) is not _STOP:
            self._busy_since = time.monotonic()
            try:
                self._work(job)
            except Exception:       # a load that fails is a miss; the loader must live on
                log.exception("prefix cache disk load failed")
            finally:
                self._busy_since = None
