"""Named accelerators for the roofline, plus this machine from a quick measurement.

Peak numbers are vendor dense (no structured sparsity) tensor-core rates per GPU; prices are
illustrative on-demand cloud $/GPU-hour (override with --usd-per-gpu-hour); a profile without a
price (``usd_per_hour`` None, e.g. the measured ``local``) has no $ per task. Every number here
is printed by the report as an assumption.
"""

from __future__ import annotations

import os
import time
from dataclasses import asdict, dataclass, replace

T = 1e12


@dataclass(frozen=True)
class Hardware:
    name: str
    peak_flops: dict            # by compute dtype: "bf16", "fp8", "int8" -> FLOP/s
    mem_bw: float               # bytes/s
    mem_bytes: float            # device memory
    usd_per_hour: float | None   # None: no price, so no $ per task
    note: str

    def peak(self, dtype: str) -> float:
        return self.peak_flops.get(dtype, self.peak_flops["bf16"])

    def with_price(self, usd_per_hour: float | None) -> "Hardware":
        return self if usd_per_hour is None else replace(self, usd_per_hour=usd_per_hour)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "Hardware":
        """A profile stored with a run (e.g. compare's hardware_local.json)."""
        try:
            price = d.get("usd_per_hour")
            return cls(str(d["name"]), {k: float(v) for k, v in d["peak_flops"].items()},
                       float(d["mem_bw"]), float(d["mem_bytes"]), None if price is None else float(price),
                       str(d.get("note", "")))
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise ValueError(f"hardware profile: missing or bad field ({exc})") from exc


HARDWARE = {
    "h100": Hardware("H100 SXM", {"bf16": 989 * T, "fp8": 1979 * T, "int8": 1979 * T}, 3.35e12, 80e9, 2.50,
                     "NVIDIA H100 SXM5 80GB HBM3, dense tensor-core peaks"),
    "h200": Hardware("H200 SXM", {"bf16": 989 * T, "fp8": 1979 * T, "int8": 1979 * T}, 4.8e12, 141e9, 3.50,
                     "NVIDIA H200 SXM 141GB HBM3e, same compute as H100"),
    "b200": Hardware("B200", {"bf16": 2250 * T, "fp8": 4500 * T, "int8": 4500 * T}, 8.0e12, 180e9, 5.50,
                     "NVIDIA HGX B200 180GB HBM3e, dense tensor-core peaks"),
    "mi355x": Hardware("MI355X", {"bf16": 2500 * T, "fp8": 5000 * T, "int8": 5000 * T}, 8.0e12, 288e9, 4.00,
                       "AMD Instinct MI355X 288GB HBM3e, dense matrix-core peaks"),
}
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
