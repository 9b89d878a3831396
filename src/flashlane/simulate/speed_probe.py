"""How fast this machine runs right now, measured the same way at calibration and beside a
measured run, so a simulation can price the run's steps at the speed the machine had then.

A calibration describes the minutes it was measured in. These VMs drift within a session without
any load figure showing it (2026-12-07, an Emerald Rapids VM at load ~0: one core's float32
matmul ran 205-210 GFLOP/s at midday and 150 three hours later, and every simulated side of a
compare run then under-predicted by 19-34%). The probe is three fixed pieces of an engine step's
work in the engine's dtype and thread count, each timed as the fastest of a few repeats (noise
only adds time: over ten probes in a row the fastest matmul varied 0.9% and the median 6.1%, the
weight read 6.0% and 18.3%):

- ``compute_s``: a prefill-sized matmul (256 rows), as a chunk's projections and MLP run;
- ``memory_s``: a matrix-vector product over more weights than the L3 holds, as a decode step reads them;
- ``host_s``: a few thousand tiny tensor ops, as the Python and dispatch of a step cost.

A probe first waits (up to ``QUIET_WAIT_S``) until the machine's CPU use falls below
``QUIET_BUSY_PCT`` of a core, so work left over in this VM (a server finishing a round) is not
timed as the machine's speed. The VM's own figures do not show everything: in one compare run
every probe started at 0-5% of a core, and 3 of 12 still ran 25-85% slow (host ops 4.5 -> 8.2
ms, the fastest repeat included): slowdowns of a few seconds from outside the VM, which is why
a compare round is bracketed by two probes.

``drift`` compares the probes taken beside a run with the calibration's: per piece the ratio of
the probes' medians (now over then, >1: slower now), applied to the step-cost model's peak FLOP/s, memory bandwidth and
host terms and to the front end's times (``scale_cost`` / ``scale_front_end``).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, replace
from typing import TYPE_CHECKING

from ..analyze.step_cost import HOST_TERMS, StepCostModel

if TYPE_CHECKING:
    from .front_end import FrontEnd

PROBE_VERSION = 2                   # 2: the fastest repeat (1: the median)
COMPUTE_SHAPE = (256, 1024, 2816)   # rows x in x out
MEMORY_BYTES = 384 << 20            # above the largest L3 these VMs report (260 MiB)
MEMORY_ROWS = 4096
HOST_OPS = 2000
REPEATS = 7
QUIET_WAIT_S = 5.0
QUIET_BUSY_PCT = 10.0               # of one core, all processes but nothing of this one's probe yet
QUIET_WINDOW_S = 0.2
WARM_S = 0.15
FRONT_END_TIMES = ("request_s", "per_prompt_token_s", "token_s", "step_gap_s")


@dataclass(frozen=True)
class SpeedProbe:
    compute_s: float
    memory_s: float
    host_s: float
    dtype: str
    threads: int
    at: float                       # unix time
    version: int = PROBE_VERSION
    quiet_wait_s: float = 0.0       # how long it waited for the machine to go quiet
    busy_pct: float | None = None   # the machine's CPU use (% of one core) when it started

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: Mapping) -> "SpeedProbe":
        try:
            busy = d.get("busy_pct")
            probe = cls(float(d["compute_s"]), float(d["memory_s"]), float(d["host_s"]), str(d["dtype"]),
                        int(d["threads"]), float(d["at"]), int(d.get("version", 0)),
                        float(d.get("quiet_wait_s", 0.0)), None if busy is None else float(busy))
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"speed probe: missing or bad field ({exc})") from None
        if min(probe.compute_s, probe.memory_s, probe.host_s) <= 0:
            raise ValueError("speed probe: its times must be > 0")
        return probe


def _fastest_s(fn, repeats: int) -> float:
    t_end = time.perf_counter() + WARM_S        # first-touch pages, kernel selection; in a fresh
    while time.perf_counter() < t_end:          # process the first 20 matmuls ran 11% slow
        fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def wait_for_quiet(max_s: float = QUIET_WAIT_S, busy_pct: float = QUIET_BUSY_PCT) -> tuple[float, float]:
    """Wait until the machine's CPU use over a short window is below ``busy_pct`` of one core, or
    ``max_s`` passed: (seconds waited, the last reading)."""
    import psutil

    t0 = time.monotonic()
    while True:
        pct = psutil.cpu_percent(interval=QUIET_WINDOW_S) * (psutil.cpu_count() or 1)
        waited = time.monotonic() - t0
        if pct < busy_pct or waited >= max_s:
            return waited, pct


def measure_speed(dtype: str = "float32", threads: int = 1, repeats: int = REPEATS,
                  quiet_s: float = QUIET_WAIT_S) -> SpeedProbe:
    """The probe in this process at ``threads`` torch threads (restored after), about 1.4 s after
    waiting up to ``quiet_s`` for the machine to go quiet (0: no wait)."""
    import torch

    dt = getattr(torch, dtype, None)
    if not isinstance(dt, torch.dtype):
        raise ValueError(f"speed probe: unknown dtype {dtype!r}")
    if not (isinstance(threads, int) and threads >= 1):
        raise ValueError(f"speed probe: threads must be an integer >= 1, got {threads!r}")
    waited, busy = wait_for_quiet(quiet_s) if quiet_s > 0 else (0.0, None)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        with torch.inference_mode():
            gen = torch.Generator().manual_seed(0)
            m, k, n = COMPUTE_SHAPE
            a, b = torch.randn(m, k, generator=gen).to(dt), torch.randn(k, n, generator=gen).to(dt)
            cols = MEMORY_BYTES // (MEMORY_ROWS * dt.itemsize)
            w, x = torch.empty(MEMORY_ROWS, cols, dtype=dt).fill_(0.5), torch.ones(1, MEMORY_ROWS, dtype=dt)
            tiny = torch.zeros(16, dtype=dt)

            def host():
                for _ in range(HOST_OPS):
                    tiny.add_(1)

            compute_s = _fastest_s(lambda: torch.mm(a, b), repeats)
            memory_s = _fastest_s(lambda: torch.mm(x, w), repeats)
            host_s = _fastest_s(host, repeats)
    finally:
        torch.set_num_threads(before)
    return SpeedProbe(compute_s, memory_s, host_s, dtype, threads, time.time(), PROBE_VERSION, waited, busy)


@dataclass(frozen=True)
class Drift:
    """The machine now against when it was calibrated: time ratios (>1: slower now)."""
    compute: float
    memory: float
    host: float
    probes_now: int
    probes_then: int

    def to_dict(self) -> dict:
        return asdict(self)

    def scale_cost(self, model: StepCostModel) -> StepCostModel:
        """``model`` at this speed: peak FLOP/s and bandwidth divided by their ratios, the host
        terms (per step, per sequence, per dispatch) times the host ratio."""
        coeffs = {**model.coefficients, **{t: model.coefficients[t] * self.host for t in HOST_TERMS}}
        return StepCostModel(model.work, model.peak_flops / self.compute, model.mem_bw / self.memory, coeffs)

    def scale_front_end(self, front: "FrontEnd") -> "FrontEnd":
        """The front end's times (admission, delivery, the pause between steps) times the host ratio;
        its served-step scales are ratios of step times and stay."""
        return replace(front, **{k: getattr(front, k) * self.host for k in FRONT_END_TIMES})


def drift(now: Sequence[SpeedProbe], then: Sequence[SpeedProbe]) -> tuple[Drift | None, str | None]:
    """The drift from the calibration's probes ``then`` to the run's ``now`` (medians of each), or
    None and why not (no probes on a side, another dtype, thread count or probe version)."""
    if not now:
        return None, "no speed probe beside the run"
    if not then:
        return None, "the calibration has no speed probe (calibrated before probes were taken)"
    kinds = {(p.dtype, p.threads, p.version) for p in [*now, *then]}
    if len(kinds) > 1:
        return None, ("the probes differ in dtype, threads or version: "
                      + ", ".join(f"{d} x{t} v{v}" for d, t, v in sorted(kinds)))

    def ratio(field: str) -> float:
        return statistics.median(getattr(p, field) for p in now) / statistics.median(getattr(p, field) for p in then)

    return Drift(ratio("compute_s"), ratio("memory_s"), ratio("host_s"), len(now), len(then)), None
