"""Telemetry sampled during a run, timestamped on the bench clock: the server's Prometheus
`/metrics` (every numeric sample kept, names as exposed), the server process tree's CPU% and RSS
when it runs on this host (psutil), GPUs through NVML when present (utilisation, memory, power,
energy), and the bench client's own CPU%. A flashlane server also hands over its engine step
records (``GET /debug/steps``) at the end, mapped onto the bench clock: the engine's own
utilisation timeline, used instead of CPU%/NVML when present."""

from __future__ import annotations

import asyncio
import csv
import json
import math
import os
import re
import time
from pathlib import Path
from urllib.parse import urlparse

import httpx

from .clock import now

_SAMPLE_RE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*(?:\{[^}]*\})?)\s+(\S+)")


def parse_prometheus(text: str) -> dict[str, float]:
    """{'name{labels}': value} for every sample line."""
    out = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = _SAMPLE_RE.match(line.strip())
        if not m:
            continue
        try:
            out[m.group(1)] = float(m.group(2))
        except ValueError:
            continue
    return out


def find_local_server_pid(base_url: str) -> int | None:
    """PID listening on the URL's port when the host is this machine (not ourselves)."""
    u = urlparse(base_url)
    if u.hostname not in ("127.0.0.1", "localhost", "0.0.0.0", "::1"):
        return None
    port = u.port or (443 if u.scheme == "https" else 80)
    try:
        import psutil
        for c in psutil.net_connections(kind="tcp"):
            if c.status == "LISTEN" and c.laddr and c.laddr.port == port and c.pid:
                return None if c.pid == os.getpid() else c.pid
    except Exception:
        return None
    return None


class _ProcTree:
    def __init__(self, pid: int, children: bool = True):
        import psutil
        self.psutil = psutil
        self.root = psutil.Process(pid)
        self.children = children
        self.known: dict[int, object] = {}

    def sample(self) -> tuple[float, float] | None:
        """(cpu percent summed over the tree, rss bytes); None once the process is gone."""
        ps = self.psutil
        try:
            procs = [self.root] + (self.root.children(recursive=True) if self.children else [])
        except ps.Error:
            return None
        cpu, rss = 0.0, 0.0
        for p in procs:
            q = self.known.get(p.pid)
            try:
                if q is None:
                    # first sight primes the counter; reading it at once would divide one clock
                    # tick of CPU by microseconds of wall time (seen: "3116% of a core")
                    self.known[p.pid] = p
                    p.cpu_percent(None)
                else:
                    cpu += q.cpu_percent(None)
                rss += p.memory_info().rss
            except ps.Error:
                self.known.pop(p.pid, None)
        return cpu, rss


class _Nvml:
    def __init__(self):
        import pynvml
        pynvml.nvmlInit()
        self.nv = pynvml
        self.handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(pynvml.nvmlDeviceGetCount())]
        self.names = [str(pynvml.nvmlDeviceGetName(h)) for h in self.handles]

    def sample(self):
        nv = self.nv
        for i, h in enumerate(self.handles):
            for name, fn in (("util", lambda: nv.nvmlDeviceGetUtilizationRates(h).gpu / 100.0),
                             ("mem_used_bytes", lambda: nv.nvmlDeviceGetMemoryInfo(h).used),
                             ("power_w", lambda: nv.nvmlDeviceGetPowerUsage(h) / 1000.0),
                             ("energy_j", lambda: nv.nvmlDeviceGetTotalEnergyConsumption(h) / 1000.0)):
                try:
                    yield f"gpu{i}", name, float(fn())
                except Exception:
                    continue


class Telemetry:
    def __init__(self, base_url: str, server_pid: int | None = None, scrape_interval_s: float = 1.0,
                 sample_interval_s: float = 0.2, use_nvml: bool = True):
        if scrape_interval_s <= 0 or sample_interval_s <= 0:
            raise ValueError("telemetry intervals: must be > 0")
        self.base_url = base_url.rstrip("/")
        self.server_pid = server_pid
        self.scrape_interval_s = scrape_interval_s
        self.sample_interval_s = sample_interval_s
        self.samples: list[tuple[float, str, str, float]] = []
        self.first_scrape: str | None = None
        self.last_scrape: str | None = None
        self.scrape_errors = 0
        self.nvml = None
        if use_nvml:
            try:
                self.nvml = _Nvml()
            except Exception:
                self.nvml = None
        self.proc = None
        if server_pid:
            try:
                self.proc = _ProcTree(server_pid)
            except Exception:
                self.proc = None
        try:
            # the client alone: servers this process launched (compare, tests) are its children
            self.me = _ProcTree(os.getpid(), children=False)
        except Exception:
            self.me = None
        self._stop = asyncio.Event()
        self._tasks: list[asyncio.Task] = []
        # the bench clock is monotonic; step records are wall-clock: one offset maps them (same host)
        self.wall_minus_bench = time.time() - now()
        self.started_at: float | None = None
        self.engine_steps: list[dict] | None = None   # None: the server has no /debug/steps
        self.engine_steps_complete = True            # False: the ring buffer lost the window's start

    @property
    def utilisation_series(self) -> str | None:
        """Name of the series that stands for 'device busy' (fraction 0..1), if any."""
        if self.nvml and self.nvml.handles:
            return "gpu0.util"
        if self.proc:
            return "server.busy"
        return None

    def start(self) -> None:
        self.started_at = now()
        self._tasks = [asyncio.create_task(self._scrape_loop()), asyncio.create_task(self._sample_loop())]

    async def stop(self) -> None:
        self._stop.set()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self.started_at is not None:
            async with httpx.AsyncClient(timeout=30.0) as client:
                await self.fetch_engine_steps(client, self.started_at)

    async def fetch_engine_steps(self, client: httpx.AsyncClient, since: float, max_pages: int = 100) -> None:
        """Engine step records ending after bench-clock ``since``, on the bench clock (start/end;
        every other field as served). Leaves ``engine_steps`` None when the endpoint does not
        answer (not a flashlane server, or an older one)."""
        steps: list[dict] = []
        cursor = since + self.wall_minus_bench
        for _ in range(max_pages):
            try:
                r = await client.get(self.base_url + "/debug/steps", params={"since": cursor})
                doc = r.json() if r.status_code == 200 else None
            except (httpx.HTTPError, ValueError):
                doc = None
            if not isinstance(doc, dict) or not isinstance(doc.get("steps"), list):
                if not steps:
                    return
                break
            page = doc["steps"]
            if not steps and doc.get("dropped") and (doc.get("oldest_start") or 0) > cursor:
                self.engine_steps_complete = False
            for rec in page:
                steps.append({**rec, "start": rec["start"] - self.wall_minus_bench,
                              "end": rec["end"] - self.wall_minus_bench})
            if not doc.get("more") or not page:
                break
            cursor = page[-1]["end"]
        self.engine_steps = steps

    async def _tick(self, interval: float) -> bool:
        try:
            await asyncio.wait_for(self._stop.wait(), timeout=interval)
            return False
        except asyncio.TimeoutError:
            return True

    async def _scrape_loop(self):
        async with httpx.AsyncClient(timeout=5.0) as client:
            while True:
                await self.scrape_once(client)
                if not await self._tick(self.scrape_interval_s):
                    await self.scrape_once(client)
                    return

    async def scrape_once(self, client: httpx.AsyncClient):
        t = now()
        try:
            r = await client.get(self.base_url + "/metrics")
            if r.status_code != 200:
                self.scrape_errors += 1
                return
        except httpx.HTTPError:
            self.scrape_errors += 1
            return
        text = r.text
        if self.first_scrape is None:
            self.first_scrape = text
        self.last_scrape = text
        for k, v in parse_prometheus(text).items():
            if math.isfinite(v):
                self.samples.append((t, "metrics", k, v))

    async def _sample_loop(self):
        while True:
            last = now()
            self.sample_once()
            if not await self._tick(self.sample_interval_s):
                # a closing sample only over a fair interval: CPU percent over a few milliseconds is
                # one clock tick divided by them (seen: a short round's client "at 119% of a core")
                if now() - last >= self.sample_interval_s / 2:
                    self.sample_once()
                return

    def sample_once(self):
        t = now()
        if self.proc:
            s = self.proc.sample()
            if s is not None:
                cpu, rss = s
                self.samples += [(t, "server", "cpu_percent", cpu), (t, "server", "rss_bytes", rss),
                                 (t, "server", "busy", min(1.0, cpu / 100.0))]
        if self.me:
            s = self.me.sample()
            if s is not None:
                self.samples.append((t, "client", "cpu_percent", s[0]))
        if self.nvml:
            for src, name, v in self.nvml.sample():
                self.samples.append((t, src, name, v))

    def series(self, key: str) -> tuple[list[float], list[float]]:
        """(times, values) of 'source.name' (for metrics: 'metrics.<sample key>')."""
        src, name = key.split(".", 1)
        pts = [(t, v) for t, s, n, v in self.samples if s == src and n == name]
        return [t for t, _ in pts], [v for _, v in pts]

    def metric_matching(self, suffix: str) -> tuple[list[float], list[float]]:
        """Sum over every scraped sample whose name (labels stripped) ends with `suffix`."""
        acc: dict[float, float] = {}
        for t, s, n, v in self.samples:
            if s == "metrics" and n.split("{", 1)[0].endswith(suffix):
                acc[t] = acc.get(t, 0.0) + v
        ts = sorted(acc)
        return ts, [acc[t] for t in ts]

    def write(self, folder: Path, t0: float) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        with open(folder / "samples.csv", "w", newline="") as f:
            w = csv.writer(f)
            w.writerow(["t_rel_s", "t", "source", "name", "value"])
            for t, s, n, v in self.samples:
                w.writerow([f"{t - t0:.4f}", f"{t:.6f}", s, n, repr(v)])
        if self.engine_steps is not None:
            with open(folder / "engine_steps.jsonl", "w") as f:
                f.writelines(json.dumps(r) + "\n" for r in self.engine_steps)
        if self.first_scrape is not None:
            (folder / "metrics_first.prom").write_text(self.first_scrape)
            (folder / "metrics_last.prom").write_text(self.last_scrape or "")

    def hardware(self) -> dict:
        return {"gpus": list(self.nvml.names) if self.nvml else [],
                "server_pid": self.server_pid if self.proc else None}
