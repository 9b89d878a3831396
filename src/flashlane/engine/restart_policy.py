"""When a dead engine process is started again: after an exponential backoff (``backoff_s``,
doubling with each restart in the window, at most ``max_backoff_s``), and at most
``max_restarts`` times within ``window_s`` seconds. Restarts older than the window are
forgotten, so an engine that ran well for a while starts again from the first backoff.

Not thread-safe: its owner holds a lock around it."""

from __future__ import annotations

from collections import deque

DEFAULT_MAX_RESTARTS = 5
DEFAULT_RESTART_BACKOFF_S = 1.0
MAX_BACKOFF_S = 30.0
RESTART_WINDOW_S = 600.0


class RestartPolicy:
    def __init__(self, max_restarts: int = DEFAULT_MAX_RESTARTS, backoff_s: float = DEFAULT_RESTART_BACKOFF_S,
                 max_backoff_s: float = MAX_BACKOFF_S, window_s: float = RESTART_WINDOW_S):
        if max_restarts < 0:
            raise ValueError(f"the engine restart limit (--engine-restarts) must be >= 0, got {max_restarts}")
        if not 0 < backoff_s <= max_backoff_s:
            raise ValueError(f"the engine restart backoff (--engine-restart-backoff) must be > 0 and at most "
                             f"{max_backoff_s:g} s, got {backoff_s}")
        self.max_restarts, self.backoff_s, self.max_backoff_s, self.window_s = (
            max_restarts, backoff_s, max_backoff_s, window_s)
        self._restarts: deque[float] = deque()   # times of the restarts tried within the window

    def recent(self, now: float) -> int:
        """Restarts tried within the window ending at ``now``."""
        while self._restarts and now - self._restarts[0] >= self.window_s:
            self._restarts.popleft()
        return len(self._restarts)

    def may_restart(self, now: float) -> bool:
        return self.recent(now) < self.max_restarts

    def backoff(self, now: float) -> float:
        """The wait before the next restart."""
        return min(self.max_backoff_s, self.backoff_s * 2 ** self.recent(now))

    def record(self, now: float) -> None:
        """A restart was tried at ``now`` (whether or not the engine came up)."""
        self._restarts.append(now)
