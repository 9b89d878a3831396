"""What the CPU can do natively (int8 dot products, bf16), a tiny timer for start-up choices, and
the dtype ``dtype="auto"`` picks on CPU from them.

``dtype="auto"`` means, on CPU: bfloat16 where the CPU has native bf16 (AVX512_BF16 / AMX) and a
start-up timing finds it at least 10% faster than float32 at 64 rows (prefill) and no slower at
1 row (decode, timed on a weight larger than the cache), else float32
(``FLASHLANE_AUTO_DTYPE=float32|bfloat16`` pins it); on GPU: the checkpoint's declared dtype
(else bfloat16). The GPU half lives in ``models.loader.resolve_dtype``.

torch's ``get_cpu_capability()`` names the vector width (``AVX2``, ``AVX512``, ``AMX``...) but
not the int8 / bf16 instructions the int8 and bf16 paths need, so /proc/cpuinfo flags are read
too. ``CpuCaps`` is a plain value so that unit tests inject any machine they like.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import torch

INT8_DOT_FLAGS = ("avx512_vnni", "avx_vnni", "amx_int8")   # int8 x int8 -> int32 dot instructions
BF16_FLAGS = ("avx512_bf16", "amx_bf16")                   # native bf16 dot products


@dataclass(frozen=True)
class CpuCaps:
    capability: str                 # torch.backends.cpu.get_cpu_capability(), e.g. "AVX2"
    flags: frozenset[str] = frozenset()

    @property
    def int8_dot(self) -> bool:
        return any(f in self.flags for f in INT8_DOT_FLAGS) or "AMX" in self.capability.upper()

    @property
    def native_bf16(self) -> bool:
        return any(f in self.flags for f in BF16_FLAGS) or "AMX" in self.capability.upper()

    def describe(self) -> str:
        extras = [name for name, on in (("int8-dot", self.int8_dot), ("bf16", self.native_bf16)) if on]
        return f"{self.capability}" + (f" ({', '.join(extras)})" if extras else " (no int8-dot, no bf16)")


def _cpuinfo_flags(path: str = "/proc/cpuinfo") -> frozenset[str]:
    try:
        for line in Path(path).read_text().splitlines():
            if line.startswith("flags"):
                return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()   # not Linux: only torch's capability string is known


@functools.lru_cache(maxsize=1)
def detect_cpu_caps() -> CpuCaps:
    return CpuCaps(torch.backends.cpu.get_cpu_capability(), _cpuinfo_flags())


T = TypeVar("T")
_TIMINGS: dict[tuple, object] = {}


def timed_once(key: tuple, measure: Callable[[], T]) -> T:
    """``measure()`` once per process for ``key`` at the current torch thread count: several
    engines started in one process time each start-up case once."""
    full = (*key, torch.get_num_threads())
    if full not in _TIMINGS:
        _TIMINGS[full] = measure()
    return _TIMINGS[full]


def best_time(fn: Callable[[], object], reps: int = 3) -> float:
    """Seconds of the fastest of ``reps`` calls after one warm-up call (min: least disturbed by
    other work on a shared machine)."""
    fn()
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


# ---- dtype="auto" on CPU ----------------------------------------------------------------------

AUTO_DTYPE_SHAPE = (2048, 1024)      # (out, in) of the timed prefill matmul: a small model's MLP
# decode streams every weight once per token: time it on a matrix larger than the last-level cache
# (64 MiB in fp32), or a hot-cache timing hides what bf16's halved bytes buy and flips between runs
AUTO_DTYPE_DECODE_SHAPE = (8192, 2048)
AUTO_DTYPE_ROWS = (1, 64)            # decode and prefill row counts; bf16 must win at both
# bf16 / fp32 time bf16 must beat, by row count. Prefill: 10% faster, so a coin-flip timing on a
# busy machine keeps fp32. Decode: no slower. A 1-row bf16 GEMV on these CPUs runs only 10-30%
# ahead of fp32 (far from its halved bytes), so a 10% bar there flipped the choice between runs.
BF16_MARGIN = {1: 1.0, 64: 0.9}
# Or a prefill win no timing noise hides (AMX: 3-5x at 64 rows) with decode at most 1.5x slower:
# on a Sapphire Rapids the 1-row ratio ranged 0.92-1.26 between runs, so "no slower" alone picked
# fp32 or bf16 by chance, and with it every number measured after it.
BF16_CLEAR_PREFILL_WIN = 0.5
BF16_DECODE_ALLOWANCE = 1.5
AUTO_DTYPE_REPS = 7                  # fp32 and bf16 calls alternated, best of each

DtypeTimer = Callable[[torch.dtype, int], float]   # (dtype, rows) -> seconds


@dataclass(frozen=True)
class DtypeChoice:
    dtype: str                       # "float32" | "bfloat16"
    why: str


def _linear(dtype: torch.dtype, rows: int):
    g = torch.Generator().manual_seed(0)
    shape = AUTO_DTYPE_DECODE_SHAPE if rows == 1 else AUTO_DTYPE_SHAPE
    w = torch.randn(shape, generator=g).to(dtype)
    x = torch.randn(rows, shape[1], generator=g).to(dtype)
    return lambda: torch.nn.functional.linear(x, w)


def time_linear_pair(rows: int, reps: int = AUTO_DTYPE_REPS) -> tuple[float, float]:
    """(fp32, bf16) seconds of one linear at ``rows`` rows, calls alternated so a neighbour's
    burst lands on both; the best of each."""
    with torch.inference_mode():
        f, b = _linear(torch.float32, rows), _linear(torch.bfloat16, rows)
        f(), b()
        best_f = best_b = float("inf")
        for _ in range(reps):
            for fn, which in ((f, "f"), (b, "b")):
                t0 = time.perf_counter()
                fn()
                dt = time.perf_counter() - t0
                if which == "f":
                    best_f = min(best_f, dt)
                else:
                    best_b = min(best_b, dt)
    return best_f, best_b


def _rows(rows: list[int]) -> str:
    return f"{' and '.join(map(str, rows))} row{'s' if rows != [1] else ''}"


def choose_cpu_dtype(caps: CpuCaps, timer: DtypeTimer | None = None) -> DtypeChoice:
    """bfloat16 only where the CPU has native bf16 and a short timing finds it at least as fast
    as ``BF16_MARGIN`` asks at every row count of ``AUTO_DTYPE_ROWS`` (no slower at decode, 10%
    faster at prefill), or at least 2x faster at prefill and at most 1.5x slower at decode;
    float32 otherwise. ``why`` names the row counts where bf16 lost."""
    if not caps.native_bf16:
        return DtypeChoice("float32", f"cpu {caps.describe()}: no native bf16")
    if timer is None:
        times = {rows: time_linear_pair(rows) for rows in AUTO_DTYPE_ROWS}
    else:
        times = {rows: (timer(torch.float32, rows), timer(torch.bfloat16, rows)) for rows in AUTO_DTYPE_ROWS}
    slow = [rows for rows, (f, b) in times.items() if b > BF16_MARGIN[rows] * f]
    timed = ", ".join(f"{_rows([rows])} fp32 {f * 1e3:.2f}ms bf16 {b * 1e3:.2f}ms" for rows, (f, b) in times.items())
    (f1, b1), (fp, bp) = times[1], times[max(times)]
    if slow and bp <= BF16_CLEAR_PREFILL_WIN * fp and b1 <= BF16_DECODE_ALLOWANCE * f1:
        return DtypeChoice("bfloat16", f"cpu {caps.describe()}: {timed} -> bf16 >={round(1 / BF16_CLEAR_PREFILL_WIN)}x "
                                       f"faster at {_rows([max(times)])}, decode within {BF16_DECODE_ALLOWANCE}x")
    bar = {rows: "no slower" if m >= 1.0 else f">={round((1 - m) * 100)}% faster" for rows, m in BF16_MARGIN.items()}
    verdict = ("bf16 short of " + ", ".join(f"{bar[r]} at {_rows([r])}" for r in slow) if slow
               else "bf16 " + ", ".join(f"{bar[r]} at {_rows([r])}" for r in times))
    return DtypeChoice("float32" if slow else "bfloat16", f"cpu {caps.describe()}: {timed} -> {verdict}")


@functools.lru_cache(maxsize=1)
def auto_cpu_dtype() -> DtypeChoice:
    """``choose_cpu_dtype`` for this machine, timed once per process."""
    return choose_cpu_dtype(detect_cpu_caps())

