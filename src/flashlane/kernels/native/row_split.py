"""Run a native kernel over rows split across torch's intra-op thread count: the kernels are
single-threaded and a ctypes call releases the GIL, so a few Python threads keep every core busy."""

from __future__ import annotations

import functools
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import torch


@functools.lru_cache(maxsize=8)
def _pool(threads: int) -> ThreadPoolExecutor:
    return ThreadPoolExecutor(threads, thread_name_prefix="flashlane-native")


def run_split(call: Callable[[int, int], None], rows: int, min_rows: int) -> None:
    """``call(first, count)`` over rows ``[0, rows)`` in at most ``torch.get_num_threads()`` parts
    of at least ``min_rows`` rows each (one part: called here)."""
    threads = max(1, min(torch.get_num_threads(), rows // max(min_rows, 1)))
    if threads == 1:
        call(0, rows)
        return
    step = -(-rows // threads)
    list(_pool(threads).map(lambda a: call(a, min(step, rows - a)), range(0, rows, step)))
