"""Backpressure: a bound on sequences in flight (running + queued), checked before any work.

Counting at the server (not reading engine queues) makes the decision exact and immediate: a
burst that arrives between two engine steps is counted before the engine has seen any of it.
"""

from __future__ import annotations

from .errors import APIError


class Ticket:
    def __init__(self, owner: "Admission", n: int):
        self.owner, self.n = owner, n

    def release(self) -> None:
        if self.n:
            self.owner.in_flight -= self.n
            self.n = 0


class Admission:
    def __init__(self, limit: int | None):
        if limit is not None and limit < 1:
            raise ValueError(f"admission limit must be >= 1, got {limit}")
        self.limit = limit
        self.in_flight = 0
        self.closed = False

    def admit(self, n: int, param: str = "n") -> Ticket:
        if self.closed:
            raise APIError(503, "the server is shutting down")
        if self.limit is not None:
            if n > self.limit:
                raise APIError(400, f"this request needs {n} sequences; the server admits at most "
                                    f"{self.limit} at once", param)
            if self.in_flight + n > self.limit:
                raise APIError(429, f"server is at capacity ({self.in_flight} of {self.limit} sequences "
                                    "running or queued); retry later", headers={"Retry-After": "1"})
        self.in_flight += n
        return Ticket(self, n)
