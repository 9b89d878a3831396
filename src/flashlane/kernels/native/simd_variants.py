"""Kernels built twice from one source: ``avx2`` (8-lane vectors) and ``avx512`` (16 lanes, where
/proc/cpuinfo lists avx512f and it builds), chosen once by what the CPU has. Each pair rounds
alike, lane for lane (``index_scores``, ``swiglu``)."""

from __future__ import annotations

import functools
from collections.abc import Callable

from ..cpu_caps import CpuCaps, detect_cpu_caps
from . import row_gemm
from .build import why_unavailable

VARIANT_FLAGS = {"avx2": row_gemm.ARCH_FLAGS, "avx512": (*row_gemm.ARCH_FLAGS, "-mavx512f")}


def cpu_unavailable(variant: str, caps: CpuCaps | None = None) -> str | None:
    """Why a CPU with ``caps`` (default: this one) cannot run ``variant``; None: it can."""
    caps = detect_cpu_caps() if caps is None else caps
    if variant == "avx512" and "avx512f" not in caps.flags:
        return "the CPU lacks avx512f"
    return row_gemm.cpu_unavailable(caps)


class Variants:
    """One kernel's two builds: ``bind(variant)`` builds, loads and types a build's functions.
    ``unavailable(variant=None)`` and ``best()`` are each decided once per process."""

    def __init__(self, bind: Callable[[str], object]):
        self._bind = bind
        self.unavailable = functools.lru_cache(maxsize=None)(self._unavailable)
        self.best = functools.lru_cache(maxsize=1)(self._best)

    def _unavailable(self, variant: str | None = None) -> str | None:
        """Why ``variant`` (default: the one this CPU gets) cannot run here (None: it can)."""
        variant = variant or self.best()
        return why_unavailable(cpu_unavailable(variant), lambda: self._bind(variant))

    def _best(self) -> str:
        """``avx512`` where it runs here, else ``avx2``."""
        return "avx512" if self.unavailable("avx512") is None else "avx2"
