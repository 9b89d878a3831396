"""The one monotonic clock every bench timestamp is taken on.

A simulation (``flashlane simulate``) replays the same workload code in virtual time: it swaps the
clock's source for its event loop's virtual clock for the duration of the run (``use_clock``).
"""

import time
from contextlib import contextmanager
from typing import Callable, Iterator

_source: Callable[[], float] = time.perf_counter


def now() -> float:
    """Seconds on a monotonic, high-resolution clock shared by client records and telemetry."""
    return _source()


@contextmanager
def use_clock(source: Callable[[], float]) -> Iterator[None]:
    """Take every bench timestamp from ``source`` inside the block (a simulator's virtual clock)."""
    global _source
    before, _source = _source, source
    try:
        yield
    finally:
        _source = before
