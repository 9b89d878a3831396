"""How many torch threads a CPU engine takes, and how its OpenMP threads wait, on a machine it
may share (benchmarks/threads_under_load.py, results in benchmarks/results/threads_under_load*.json).

Torch's own default is one thread per core. When another process keeps a core busy, a parallel
region waits for the thread that shares that core, and spinning OpenMP threads take the core
from it: on 2 cores beside a busy loop, tiny-flash decoded at 0.8-15 tok/s with 2 threads and
7-41 tok/s with 1; on the idle machine 2 threads were within 10% of 1. So the default is the
cores not busy at start-up minus one kept for everything else (the HTTP process beside `serve`'s
engine process, tokenising, the OS), at least one; and waiting threads sleep instead of spinning
(OMP_WAIT_POLICY=PASSIVE unless set), which kept 2 threads beside the busy loop at 12-43 tok/s.

"Busy" is sampled over a quarter of a second, not read from the load average: the load average
trails by a minute, so a server started right after another one stopped (a compare or a tune
run) would count its predecessor's work against itself. The load average only sets off the
warning that speeds measured now will be low and noisy.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass

WAIT_POLICY = "PASSIVE"
HIGH_LOAD_PER_CPU = 0.5   # a 1-minute load average above this share of the CPUs gets a warning
BUSY_SAMPLE_S = 0.25


def usable_cpus() -> list[int]:
    return sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))


def busy_cpus(cpus: list[int]) -> float | None:
    """How many of `cpus` other work keeps busy now (this process sleeps while it samples)."""
    try:
        import psutil

        per_cpu = psutil.cpu_percent(interval=BUSY_SAMPLE_S, percpu=True)
        return sum(per_cpu[c] for c in cpus if c < len(per_cpu)) / 100.0
    except (ImportError, OSError):
        return None


def load_average() -> float | None:
    try:
        return os.getloadavg()[0]
    except (AttributeError, OSError):   # not on every platform
        return None


def default_threads(cpus: int, busy: float | None, reserve: int = 1) -> int:
    """Cores neither busy with other work (rounded) nor kept for the rest (`reserve`); at least one."""
    return max(1, cpus - reserve - (round(busy) if busy is not None else 0))


def prefer_passive_waiting() -> None:
    """Idle OpenMP threads sleep instead of spinning, unless OMP_WAIT_POLICY is set. OpenMP reads
    it once, when torch loads: after that this changes nothing."""
    if "torch" not in sys.modules:
        os.environ.setdefault("OMP_WAIT_POLICY", WAIT_POLICY)


@dataclass(frozen=True)
class ThreadChoice:
    threads: int
    cpus: int
    load: float | None
    source: str           # why this count
    set_here: bool = True   # False: torch already runs in this process with this count: keep it
    busy: float | None = None

    def describe(self) -> str:
        count = f"{self.threads} torch thread{'s' if self.threads != 1 else ''}"
        busy = "" if self.busy is None else f", {self.busy:.1f} busy"
        load = "" if self.load is None else f", load average {self.load:.2f}"
        policy = os.environ.get("OMP_WAIT_POLICY", "unset")
        return f"threads: {count} ({self.source}; {self.cpus} CPUs{busy}{load}; OMP_WAIT_POLICY {policy})"

    def warning(self) -> str | None:
        if self.load is None or self.load <= HIGH_LOAD_PER_CPU * self.cpus:
            return None
        return (f"warning: the machine is busy (load average {self.load:.2f} on {self.cpus} CPUs): "
                f"speeds will be lower than on an idle machine and vary from run to run")


def choose_threads(num_threads: int | None, reserve: int = 1) -> ThreadChoice:
    """--num-threads if given; else, in a process where torch already runs (an embedding
    program, a test), the count it has there; else OMP_NUM_THREADS if set; else the cores not
    busy at start-up."""
    cpus, load = usable_cpus(), load_average()
    if num_threads is not None:
        return ThreadChoice(num_threads, len(cpus), load, "--num-threads")
    if "torch" in sys.modules:
        return ThreadChoice(sys.modules["torch"].get_num_threads(), len(cpus), load, "as set in this process",
                            set_here=False)
    omp = os.environ.get("OMP_NUM_THREADS", "").split(",")[0].strip()
    if omp.isdigit() and int(omp) > 0:
        return ThreadChoice(int(omp), len(cpus), load, "OMP_NUM_THREADS")
    busy = busy_cpus(cpus)
    return ThreadChoice(default_threads(len(cpus), busy, reserve), len(cpus), load,
                        "default: CPUs not busy at start-up, less one; --num-threads N to change", busy=busy)
