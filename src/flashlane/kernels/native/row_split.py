"""How many threads of torch's own OpenMP team a native kernel splits its rows over
(``parallel.h``): the kernels are built with OpenMP against the runtime torch has loaded, so the
team's idle threads take the parts at once; threads of our own would compete with torch's
spinning ones for the same cores (with OMP_WAIT_POLICY unset, an idle OpenMP thread spins for a
while after every parallel op)."""

from __future__ import annotations

import functools

import torch

from .build import openmp_runtimes


# values (elements of a row times rows) a thread's share of a row-wise kernel should hold at least:
# decode rows stay on one thread, a prefill chunk's rows split
PART_VALUES = 1 << 16


def team_threads(rows: int, min_rows: int) -> int:
    """Threads for ``rows`` rows in parts of at least ``min_rows`` rows: at most torch's thread
    count; 1 where the kernels got an OpenMP runtime other than torch's."""
    if not _one_openmp_runtime():
        return 1
    return max(1, min(torch.get_num_threads(), rows // max(min_rows, 1)))


def team_threads_by_values(rows: int, values_per_row: int) -> int:
    """``team_threads`` for rows of ``values_per_row`` values, in parts of at least PART_VALUES."""
    return team_threads(rows, max(1, PART_VALUES // max(values_per_row, 1)))


@functools.lru_cache(maxsize=1)
def _one_openmp_runtime() -> bool:
    """Asked after a kernel built with OpenMP has loaded (its caller holds its functions)."""
    return len(openmp_runtimes()) <= 1
