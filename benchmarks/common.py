"""Shared helpers for the benchmark scripts: machine info, timing, JSON output."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))


def machine() -> dict:
    from flashlane.kernels.cpu_caps import machine_info

    return machine_info()


def write_result(name: str, result: dict, out: str | None) -> Path:
    path = Path(out or f"benchmarks/results/{name}.json")
    path.parent.mkdir(parents=True, exist_ok=True)
    payload = {"benchmark": name, "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
               "machine": machine(), **result}
    path.write_text(json.dumps(payload, indent=2))
    print(json.dumps(payload, indent=2))
    return path


class Timer:
    def __enter__(self):
        self.t0 = time.perf_counter()
        return self

    def __exit__(self, *exc):
        self.seconds = time.perf_counter() - self.t0
