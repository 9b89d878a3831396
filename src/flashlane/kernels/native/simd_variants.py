"""Kernels built twice from one source: ``avx2`` (8-lane vectors) and ``avx512`` (16 lanes, where
/proc/cpuinfo lists avx512f and it builds), chosen once by what the CPU has. Each pair rounds
alike, lane for lane (``index_scores``, ``swiglu``, ``row_gemm``, ``decode_layer``)."""

from __future__ import annotations

import functools
from collections.abc import Callable

from ..cpu_caps import CpuCaps, detect_cpu_caps
from .build import why_unavailable

# every native kernel's base flags (F16C: the GGUF block kernels' fp16 scales)
ARCH_FLAGS = ("-mavx2", "-mfma", "-mf16c")
VARIANT_FLAGS = {"avx2": ARCH_FLAGS, "avx512": (*ARCH_FLAGS, "-mavx512f")}


def avx2_unavailable(caps: CpuCaps | None = None) -> str | None:
    """Why a CPU with ``caps`` (default: this one) cannot run the native kernels (AVX2 + FMA +
    F16C builds; every AVX2 CPU so far has F16C); None: it can."""
    caps = detect_cpu_caps() if caps is None else caps
    if caps.flags:
        missing = [f for f in ("avx2", "fma", "f16c") if f not in caps.flags]
        if missing:
            return f"the CPU lacks {', '.join(missing)}"
    elif caps.capability.upper() not in ("AVX2", "AVX512", "AMX"):
        return f"torch reports CPU capability {caps.capability}, not AVX2"
    return None


def cpu_unavailable(variant: str, caps: CpuCaps | None = None) -> str | None:
    """Why a CPU with ``caps`` (default: this one) cannot run ``variant``; None: it can."""
    caps = detect_cpu_caps() if caps is None else caps
    if variant == "avx512" and "avx512f" not in caps.flags:
        return "the CPU lacks avx512f"
    return avx2_unavailable(caps)


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
