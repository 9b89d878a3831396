"""Shared helpers for the benchmark scripts: machine info, timing, JSON output."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))


def machine() -> dict:
    from flashlane.machine import machine_info

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


@contextmanager
def served(model: str, port: int, flags: list[str] = (), ready_within_s: float = 900):
    """A ``flashlane serve`` process (fp32) on ``port``, yielded once /health answers 200."""
    import httpx

    url = f"http://127.0.0.1:{port}"
    server = subprocess.Popen(["flashlane", "serve", "--model", model, "--port", str(port), "--dtype", "float32",
                               *flags], stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    try:
        deadline = time.time() + ready_within_s
        while time.time() < deadline and server.poll() is None:
            try:
                if httpx.get(url + "/health").status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        else:
            raise RuntimeError(f"flashlane serve did not become healthy (exit code {server.poll()})")
        yield server
    finally:
        server.terminate()
        server.wait(30)
