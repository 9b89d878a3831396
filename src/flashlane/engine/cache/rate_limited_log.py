"""Warnings that repeat by the thousand (a full disk fails every write) logged once per cause:
the first occurrence in full, then at most one summary line per interval with the count."""

from __future__ import annotations

import logging
import threading
import time
from typing import Callable


class RateLimitedLog:
    def __init__(self, logger: logging.Logger, interval_s: float = 60.0,
                 clock: Callable[[], float] = time.monotonic):
        self.logger = logger
        self.interval_s = interval_s
        self._clock = clock
        self._lock = threading.Lock()
        self._causes: dict[str, list] = {}        # cause -> [last line's time, occurrences since]

    def warning(self, cause: str, message: str) -> None:
        now = self._clock()
        with self._lock:
            seen = self._causes.get(cause)
            if seen is None:
                self._causes[cause] = [now, 0]
                line = message
            else:
                seen[1] += 1
                if now - seen[0] < self.interval_s:
                    return
                line = f"{message} ({seen[1]} times since the last report of {cause})"
                seen[0], seen[1] = now, 0
        self.logger.warning(line)
