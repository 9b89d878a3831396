"""Run a native kernel over rows split across torch's intra-op thread count: the kernels are
single-threaded and a ctypes call releases the GIL, so a few Python threads keep every core busy
(``run_split``); or, for kernels built with OpenMP (``parallel.h``), how many threads of torch's
own team to ask for (``team_threads``), which needs no second set of threads beside torch's."""

from __future__ import annotations

import functools
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import torch

from .build import openmp_runtimes


@functools.lru_cache(maxsize=8)
def _pool(threads: int) -> ThreadPoolExecutor:
    return ThreadPoolExecutor(threads, thread_name_prefix="flashlane-native")


def run_split(call: Callable[[int, int], None], rows: int, min_rows: int) -> None:
    """``call(first, count)`` over rows ``[0, rows)`` in at most ``torch.get_num_threads()`` parts
    of at least ``min_rows`` rows each (one part: called here)."""
    threads = _parts(rows, min_rows)
    if threads == 1:
        call(0, rows)
        return
    step = -(-rows // threads)
    list(_pool(threads).map(lambda a: call(a, min(step, rows - a)), range(0, rows, step)))


def team_threads(rows: int, min_rows: int) -> int:
    """Threads of torch's OpenMP team for a kernel built with OpenMP: as many parts as
    ``run_split`` would make; 1 where the kernels got an OpenMP runtime other than torch's."""
    return _parts(rows, min_rows) if _one_openmp_runtime() else 1


def _parts(rows: int, min_rows: int) -> int:
    return max(1, min(torch.get_num_threads(), rows // max(min_rows, 1)))


@functools.lru_cache(maxsize=1)
def _one_openmp_runtime() -> bool:
    """Asked after a kernel built with OpenMP has loaded (its caller holds its functions)."""
    return len(openmp_runtimes()) <= 1
