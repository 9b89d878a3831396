"""How busy the machine was during a measurement, split into the servers under test, the bench
client and everything else (co-tenants), so a comparison can say when its timings are noisy.

System-wide CPU comes from psutil; the servers' and the client's share from their process trees;
the co-tenant share is what remains. All numbers are percent of one core (200 = two cores busy).
"""

from __future__ import annotations

import contextlib
import os
import threading
import time

import psutil

# A run is noisy when co-tenants took this fraction of the machine, or the client saturated a core.
COTENANT_NOISY_FRACTION = 0.25
CLIENT_NOISY_PERCENT = 85.0


def _tree(pid: int) -> list[psutil.Process]:
    try:
        p = psutil.Process(pid)
        return [p] + p.children(recursive=True)
    except psutil.Error:
        return []


class MachineLoad:
    """Context manager sampling CPU every `interval_s` in a thread; `.summary()` afterwards."""

    def __init__(self, server_pids: list[int], interval_s: float = 0.5):
        self.server_pids = [p for p in server_pids if p]
        self.interval_s = interval_s
        self.cores = psutil.cpu_count() or 1
        self.samples: list[tuple[float, float, float]] = []  # (system, servers, client)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._procs: dict[int, psutil.Process] = {}

    def _cpu(self, procs: list[psutil.Process]) -> float:
        total = 0.0
        for p in procs:
            known = self._procs.setdefault(p.pid, p)  # cpu_percent needs the same object each time
            try:
                total += known.cpu_percent(None)
            except psutil.Error:
                continue
        return total

    def _sample(self) -> tuple[float, float, float]:
        system = psutil.cpu_percent(None) * self.cores
        servers = self._cpu([q for pid in self.server_pids for q in _tree(pid)])
        client = self._cpu([psutil.Process(os.getpid())])
        return system, servers, client

    def _loop(self) -> None:
        self._sample()  # primes the counters
        while not self._stop.wait(self.interval_s):
            self.samples.append(self._sample())

    def __enter__(self) -> "MachineLoad":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def summary(self) -> dict:
        return summarize_load(self.samples, self.cores)


def summarize_load(samples: list[tuple[float, float, float]], cores: int) -> dict:
    """Means of (system, servers, client) CPU samples, the co-tenant remainder, and the verdict."""
    if not samples:
        return {"n": 0, "cores": cores, "noisy": False, "reasons": []}
    n = len(samples)
    system = sum(s[0] for s in samples) / n
    servers = sum(s[1] for s in samples) / n
    client = sum(s[2] for s in samples) / n
    cotenant = max(0.0, system - servers - client)
    reasons = []
    if cotenant > COTENANT_NOISY_FRACTION * 100 * cores:
        reasons.append(f"other processes used {cotenant:.0f}% CPU of {100 * cores}%")
    if client > CLIENT_NOISY_PERCENT:
        reasons.append(f"the bench client used {client:.0f}% of a core")
    return {"n": n, "cores": cores, "system_cpu_percent": system, "servers_cpu_percent": servers,
            "client_cpu_percent": client, "cotenant_cpu_percent": cotenant,
            "noisy": bool(reasons), "reasons": reasons}


@contextlib.contextmanager
def cotenant_cpu():
    """CPU the rest of the machine used while the block ran, from CPU-time counters (this
    process and the children it waited for on one side, the whole machine on the other): exact
    for short-lived children, which sampled percentages miss. Fills the yielded dict on exit."""
    me = psutil.Process(os.getpid())

    def ours() -> float:
        t = me.cpu_times()
        return t.user + t.system + t.children_user + t.children_system

    def machine() -> float:
        t = psutil.cpu_times()
        return sum(t) - t.idle - getattr(t, "iowait", 0.0)

    out: dict = {"cores": psutil.cpu_count() or 1}
    t0, m0, o0 = time.monotonic(), machine(), ours()
    yield out
    wall = max(time.monotonic() - t0, 1e-9)
    own = ours() - o0
    out["cotenant_cpu_percent"] = max(0.0, (machine() - m0) - own) / wall * 100.0
    out["wall_s"], out["ours_cpu_s"] = wall, own


def summarize_rounds(parts: list[dict]) -> dict:
    """Several rounds' load summaries pooled (sample-weighted means, every round's reasons kept
    with its number), plus each round's co-tenant CPU: load is recorded per round, not per run."""
    parts = [p for p in parts if p]
    n = sum(p.get("n", 0) for p in parts)
    cores = next((p["cores"] for p in parts if p.get("cores")), 1)
    out = {"n": n, "cores": cores, "rounds": [p.get("cotenant_cpu_percent") for p in parts],
           "reasons": [f"round {i}: {r}" for i, p in enumerate(parts) for r in p.get("reasons", [])]}
    for key in ("system_cpu_percent", "servers_cpu_percent", "client_cpu_percent", "cotenant_cpu_percent"):
        vals = [(p[key], p["n"]) for p in parts if p.get(key) is not None and p.get("n")]
        out[key] = sum(v * w for v, w in vals) / sum(w for _, w in vals) if vals else None
    out["noisy"] = bool(out["reasons"])
    return out
