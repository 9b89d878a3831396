"""Named accelerators for the roofline and the step-cost model, plus this machine from a quick
measurement.

The named profiles are data files (``hardware_profiles/*.json``), one per accelerator, each number
with its source: vendor dense (no structured sparsity) tensor-core peaks per GPU, HBM bandwidth
and size, the interconnect's bandwidth each way per GPU, the host cost of an eager kernel launch
and of a CUDA-graph node replay (estimates until fitted on a GPU), the stated efficiency factors,
and an illustrative on-demand cloud $/GPU-hour (override with --usd-per-gpu-hour). A profile
without a price (``usd_per_hour`` None, e.g. the measured ``local``) has no $ per task. Every
number here is printed by the report as an assumption.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path



@dataclass(frozen=True)
class Hardware:
    name: str
    peak_flops: dict            # by compute dtype: "bf16", "fp8", "int8" -> FLOP/s
    mem_bw: float               # bytes/s
    mem_bytes: float            # device memory
    usd_per_hour: float | None   # None: no price, so no $ per task
    note: str
    interconnect_bw: float | None = None   # bytes/s each way per GPU (NVLink, Infinity Fabric); None: one device
    kernel_launch_s: float | None = None   # host time of one eager kernel launch
    graph_replay_s: float | None = None    # per kernel node replayed from a captured graph
    efficiency: dict = field(default_factory=dict)   # stated "mfu" / "mbu" for this part
    sources: dict = field(default_factory=dict)      # field -> where its number comes from

    def peak(self, dtype: str) -> float:
        return self.peak_flops.get(dtype, self.peak_flops["bf16"])

    def with_price(self, usd_per_hour: float | None) -> "Hardware":
        return self if usd_per_hour is None else replace(self, usd_per_hour=usd_per_hour)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "Hardware":
        """A profile stored with a run (e.g. compare's hardware_local.json) or shipped as a file."""
        try:
            price = d.get("usd_per_hour")
            opt = {k: None if d.get(k) is None else float(d[k])
                   for k in ("interconnect_bw", "kernel_launch_s", "graph_replay_s")}
            return cls(str(d["name"]), {k: float(v) for k, v in d["peak_flops"].items()},
                       float(d["mem_bw"]), float(d["mem_bytes"]), None if price is None else float(price),
                       str(d.get("note", "")), **opt,
                       efficiency={k: float(v) for k, v in (d.get("efficiency") or {}).items()},
                       sources=dict(d.get("sources") or {}))
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise ValueError(f"hardware profile: missing or bad field ({exc})") from exc


PROFILE_DIR = Path(__file__).with_name("hardware_profiles")
_FIELDS = {f.name for f in fields(Hardware)}
# numbers a shipped profile must source
_SOURCED = ("peak_flops", "mem_bw", "mem_bytes", "interconnect_bw", "kernel_launch_s", "graph_replay_s",
            "efficiency")


def load_profile(path: str | Path) -> Hardware:
    """One profile file: unknown keys and unsourced numbers are errors naming them."""
    try:
        raw = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"hardware profile {path}: cannot read it ({exc})") from None
    unknown = sorted(set(raw) - _FIELDS)
    if unknown:
        raise ValueError(f"hardware profile {path}: unknown field(s) {', '.join(unknown)}")
    unsourced = [k for k in _SOURCED if raw.get(k) is not None and k not in (raw.get("sources") or {})]
    if unsourced:
        raise ValueError(f"hardware profile {path}: no source given for {', '.join(unsourced)}")
    bad_eff = sorted(set(raw.get("efficiency") or {}) - {"mfu", "mbu"})
    if bad_eff:
        raise ValueError(f"hardware profile {path}: efficiency has unknown factor(s) {', '.join(bad_eff)}")
    try:
        return Hardware.from_dict(raw)
    except ValueError as exc:
        raise ValueError(f"hardware profile {path}: {exc}") from None


HARDWARE = {p.stem: load_profile(p) for p in sorted(PROFILE_DIR.glob("*.json"))}
LOCAL_NAMES = ("local", "this", "cpu")


def hardware_names() -> list[str]:
    return sorted(HARDWARE) + ["local"]


def _best_time(fn, seconds: float) -> float:
    fn()  # first call: page faults, thread pool start
    best, start = float("inf"), time.perf_counter()
    while True:
        t0 = time.perf_counter()
        fn()
        t1 = time.perf_counter()
        best = min(best, t1 - t0)
        if t1 - start >= seconds:
            return best


def measure_local(seconds: float = 0.5) -> Hardware:
    """This machine: fp32 matmul rate and copy bandwidth measured with numpy (no torch)."""
    import numpy as np

    n = 512
    a = np.random.default_rng(0).standard_normal((n, n), dtype=np.float32)
    b = a.T.copy()
    src = np.ones(16 * 1024 * 1024, dtype=np.float32)   # 64 MiB, larger than caches
    dst = np.empty_like(src)
    # the best of many short repetitions: a peak rate, which a neighbour's burst cannot drag down
    # the way it drags down a mean over the whole interval
    flops = 2 * n ** 3 / _best_time(lambda: a @ b, seconds / 2)
    bw = 2 * src.nbytes / _best_time(lambda: np.copyto(dst, src), seconds / 2)
    try:
        mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        mem = 16 * 1024 ** 3
    return Hardware("this machine", {"bf16": flops, "fp8": flops, "int8": flops}, bw, float(mem), None,
                    f"measured: numpy fp32 {n}x{n} matmul and 64 MiB copy on {os.cpu_count()} CPUs; "
                    "bf16/fp8 assumed no faster than fp32")


def get_hardware(name: str, usd_per_hour: float | None = None) -> Hardware:
    key = name.strip().lower().replace("-", "").replace(" ", "")
    if key in LOCAL_NAMES:
        return measure_local().with_price(usd_per_hour)
    if key not in HARDWARE:
        raise ValueError(f"--hardware {name!r} is not one of {', '.join(hardware_names())}")
    return HARDWARE[key].with_price(usd_per_hour)



def calibrate_local(seconds: float = 0.5, timeout_s: float = 60.0) -> Hardware:
    """The `local` profile measured in a fresh interpreter (no thread pools or caches of the
    caller warm or busy), e.g. by compare before it starts servers; store `.to_dict()` with the run."""
    import json
    import subprocess
    import sys

    code = ("import json, sys; from flashlane.analyze.hardware import measure_local; "
            "print(json.dumps(measure_local(float(sys.argv[1])).to_dict()))")
    try:
        out = subprocess.run([sys.executable, "-c", code, str(seconds)], capture_output=True, text=True,
                             timeout=timeout_s, check=True).stdout
    except (subprocess.SubprocessError, OSError) as exc:
        raise ValueError(f"hardware calibration failed: {exc}") from exc
    return Hardware.from_dict(json.loads(out.strip().splitlines()[-1]))
