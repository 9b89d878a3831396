"""One record per engine step, kept in a bounded ring buffer: the engine's own utilisation
timeline (``GET /debug/steps``; bench telemetry classifies idle gaps from it).

``start``/``end`` are wall-clock (``time.time()``) so a client on the same host can align them
with its own timestamps; the duration comes from the monotonic clock, so a wall-clock jump
cannot make a step negative. A step spans scheduling, the model run and output processing;
passes that schedule nothing produce no record (that time is idle).
"""

from __future__ import annotations

import threading
from bisect import bisect_right
from collections import deque
from dataclasses import asdict, dataclass


@dataclass(frozen=True, slots=True)
class StepRecord:
    step: int                   # engine step counter (1, 2, ...; gaps in it mean dropped records)
    start: float                # time.time() when scheduling began
    end: float                  # start + monotonic duration
    start_monotonic: float      # time.monotonic() at start (engine-internal timestamps use it)
    model_s: float              # seconds inside the model run (the rest is scheduling/bookkeeping)
    sample_s: float             # of model_s, seconds sampling (logits of the sampled rows, sampler)
    num_seqs: int
    num_tokens: int
    prefill_tokens: int
    decode_tokens: int
    decode_seqs: int
    num_running: int            # after the step (finished requests removed)
    num_waiting: int            # after the step: queued, not admitted
    num_preempted: int          # requests preempted by this step's scheduling
    pages_used: int
    slots_used: int
    request_ids: tuple[str, ...]
    # the step's composition, one entry per scheduled sequence in request_ids' order: tokens
    # computed this step and tokens already in the cache before it (what a step-cost model reads)
    seq_new_tokens: tuple[int, ...] = ()
    seq_cached_tokens: tuple[int, ...] = ()
    # speculative decoding: draft tokens verified this step (counted in num_tokens) and accepted
    draft_tokens: int = 0
    accepted_tokens: int = 0
    # per scheduled sequence: its draft tokens (of seq_new_tokens); the MTP drafter's pass after
    # the step: its layer's calls and rows, and the rows drafted from (what a step-cost model prices)
    seq_draft_tokens: tuple[int, ...] = ()
    draft_calls: int = 0
    draft_rows: int = 0
    draft_logit_rows: int = 0

    @property
    def duration(self) -> float:
        return self.end - self.start

    def to_json(self, with_ids: bool = True) -> dict:
        d = asdict(self)
        d["seq_new_tokens"], d["seq_cached_tokens"] = list(self.seq_new_tokens), list(self.seq_cached_tokens)
        d["seq_draft_tokens"] = list(self.seq_draft_tokens)
        if with_ids:
            d["request_ids"] = list(self.request_ids)
        else:
            del d["request_ids"]
        return d


class StepLog:
    """The last ``maxlen`` step records. Appended by the stepping thread, read by others
    (the server's event loop), hence the lock."""

    def __init__(self, maxlen: int):
        self._records: deque[StepRecord] = deque(maxlen=maxlen)
        self._lock = threading.Lock()
        self.maxlen = maxlen
        self.total = 0              # records ever appended (total - len = dropped)

    def append(self, rec: StepRecord) -> None:
        with self._lock:
            self._records.append(rec)
            self.total += 1

    def clear(self) -> None:
        with self._lock:
            self._records.clear()
            self.total = 0

    def since(self, ts: float | None = None, limit: int | None = None) -> list[StepRecord]:
        """Records that end after wall-clock ``ts`` (all when None), oldest first; at most
        ``limit`` (the oldest ones, so a caller can page on with the last record's end)."""
        with self._lock:
            recs = list(self._records)
        if ts is not None:          # steps run one after another, so records are in end order
            recs = recs[bisect_right(recs, ts, key=lambda r: r.end):]
        return recs if limit is None else recs[:limit]

    def page(self, ts: float | None, limit: int, with_ids: bool) -> dict:
        """Up to ``limit`` records that end after ``ts`` as JSON, with the ring's bookkeeping
        (``more``: further records follow; ``dropped``: records already overwritten)."""
        recs = self.since(ts, limit + 1)
        oldest = self.oldest()
        return {"capacity": self.maxlen, "total": self.total, "dropped": self.total - len(self),
                "oldest_start": oldest.start if oldest else None, "more": len(recs) > limit,
                "steps": [r.to_json(with_ids) for r in recs[:limit]]}

    def oldest(self) -> StepRecord | None:
        with self._lock:
            return self._records[0] if self._records else None

    def __iter__(self):
        with self._lock:
            return iter(list(self._records))

    def __len__(self) -> int:
        return len(self._records)
