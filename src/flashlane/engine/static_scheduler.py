"""Static batching, the naive serving baseline: take up to ``batch_size`` waiting requests in
arrival order and run them until the longest one finishes; nobody joins a running batch, not
even into the seats its finished members leave, so length variation idles the batch.

Everything inside a batch works as in continuous batching, because the batch's members are the
only requests the base scheduler ever sees in ``waiting``: their prefills are chunked under the
token budget, prefix-cache hits and checkpoint stops apply, and a member preempted for memory
goes back to the front of ``waiting`` (still a member) and is recomputed before the batch ends.
Requests not yet in a batch queue in ``backlog``. A batch larger than the engine can hold at
once (``max_num_seqs``, pages, state slots) is admitted in waves, still before the next batch.
"""

from __future__ import annotations

from collections import deque

from .cache.manager import CacheManager
from .request import Request
from .scheduler import Scheduler, SchedulerOutput


class StaticScheduler(Scheduler):
    def __init__(self, cache: CacheManager, max_num_seqs: int, max_num_batched_tokens: int,
                 chunk_multiple: int, batch_size: int):
        super().__init__(cache, max_num_seqs, max_num_batched_tokens, chunk_multiple)
        if batch_size < 1:
            raise ValueError(f"static_batch_size must be >= 1, got {batch_size}")
        self.batch_size = batch_size
        self.backlog: deque[Request] = deque()    # arrived, not in a batch yet
        self.num_batches = 0

    def add(self, req: Request) -> None:
        self.backlog.append(req)

    def remove(self, req: Request) -> None:
        if req in self.backlog:
            self.backlog.remove(req)
            return
        super().remove(req)

    @property
    def has_work(self) -> bool:
        return bool(self.backlog) or super().has_work

    @property
    def num_waiting(self) -> int:
        return len(self.backlog) + len(self.waiting)

    @property
    def batch_open(self) -> bool:
        """A batch is open while any member is running or waiting (preempted, or not admitted yet)."""
        return bool(self.running or self.waiting)

    def schedule(self, now: float | None = None) -> SchedulerOutput:
        if not self.batch_open and self.backlog:
            for _ in range(min(self.batch_size, len(self.backlog))):
                self.waiting.append(self.backlog.popleft())
            self.num_batches += 1
        return super().schedule(now)
