"""What faults cost a running `flashlane serve` (issue 21): each case starts a real server on
loopback, keeps client traffic and a 20 ms ``/health`` poll (in a process of its own) running,
makes the fault, and records status codes, time to first error, time to recovery, ``/health``
latency and lost requests.

Cases:
- ``disk_full``: the disk tier on a 3 MB tmpfs (a size-capped directory through an injected
  writer where nothing can be mounted) under traffic that spills pages to disk;
- ``special_files``: a server restarted on a disk tier whose files are then replaced by a
  directory, a FIFO and an unreadable file; the same prompts again, outputs compared;
- ``shutdown_deadline``: SIGTERM with ``--shutdown-timeout 3`` while long streams and
  non-streaming requests run;
- ``large_bodies``: a valid 30 MB body (1000 prompts x 15,000 token ids) whose client gives up
  and disconnects;
- ``engine_sigkill``: SIGKILL of the engine-core process under traffic.

A request is *lost* when it gets no answer: a dropped connection, a non-JSON error, or a stream
that ends with neither ``[DONE]`` nor an error event. Loopback only; every loop is bounded.

    python benchmarks/faults.py [--model tiny-flash] [--cases disk_full,...] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import random
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections import Counter
from contextlib import contextmanager
from pathlib import Path

import httpx
import psutil
from common import write_result

FAULT_SERVER = str(Path(__file__).resolve().parent / "fault_server.py")
HEALTH_GOAL_MS = 100.0
WORDS = ("alpha", "beta", "gamma", "delta", "tool", "call", "result", "file", "read", "write", "the", "agent",
         "context", "page", "cache", "state", "token", "model", "serve", "query")


# ---- the server -----------------------------------------------------------------------------------

class Server:
    """One ``flashlane serve`` (through fault_server.py, so injections can be switched on)."""

    def __init__(self, model: str, port: int, flags: list[str], log_path: Path, env: dict | None = None):
        self.url = f"http://127.0.0.1:{port}"
        self.log_path = log_path
        cmd = [sys.executable, FAULT_SERVER, "--log-level", "INFO", "serve", "--model", model, "--port", str(port),
               "--dtype", "float32", *flags]
        t0 = time.monotonic()
        self._log = open(log_path, "w")
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT,
                                     env={**os.environ, **(env or {})})
        try:
            self.cold_start_s = wait_until(lambda: health_status(self.url) == 200, 900, "server start",
                                           self.proc) - t0
        except RuntimeError as exc:
            self.stop()
            raise RuntimeError(f"{exc}; its log ends: {self.log()[-600:]}") from None

    def engine_pid(self) -> int | None:
        for child in psutil.Process(self.proc.pid).children(recursive=True):
            try:
                if "spawn_main" in " ".join(child.cmdline()):
                    return child.pid
            except psutil.NoSuchProcess:
                pass
        return None

    def rss_mib(self) -> float:
        return psutil.Process(self.proc.pid).memory_info().rss / 2**20

    def stop(self, sig=signal.SIGTERM, timeout: float = 90) -> dict:
        t0 = time.monotonic()
        self.proc.send_signal(sig)
        try:
            code = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            code = self.proc.wait(30)
        self._log.close()
        return {"exit_code": code, "exit_s": round(time.monotonic() - t0, 2)}

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")


def health_status(url: str) -> int | None:
    try:
        return httpx.get(url + "/health", timeout=5).status_code
    except httpx.HTTPError:
        return None


def wait_until(predicate, timeout: float, what: str, proc=None) -> float:
    """Poll ``predicate`` every 50 ms; the time it came true (RuntimeError after ``timeout``)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"{what}: the server exited with {proc.returncode}")
        if predicate():
            return time.monotonic()
        time.sleep(0.05)
    raise RuntimeError(f"{what}: not reached within {timeout} s")


def metric(url: str, name: str) -> float | None:
    """One sample of a Prometheus metric (the first series of that name)."""
    try:
        text = httpx.get(url + "/metrics", timeout=10).text
    except httpx.HTTPError:
        return None
    m = re.search(rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$", text, re.M)
    return float(m.group(1)) if m else None


def metrics_matching(url: str, prefix: str) -> dict[str, float]:
    try:
        text = httpx.get(url + "/metrics", timeout=10).text
    except httpx.HTTPError:
        return {}
    out = {}
    for line in text.splitlines():
        if line.startswith(prefix):
            key, _, value = line.rpartition(" ")
            out[key] = float(value)
    return out


# ---- /health in a process of its own ----------------------------------------------------------------

def _poll_health(url: str, stop, conn, interval: float) -> None:
    samples = []
    with httpx.Client(timeout=10) as c:
        while not stop.is_set():
            t, t0 = time.time(), time.perf_counter()
            try:
                r = c.get(url + "/health")
                status, state = r.status_code, r.json().get("status")
            except (httpx.HTTPError, ValueError):
                status, state = None, None
            samples.append((t, time.perf_counter() - t0, status, state))
            time.sleep(interval)
    conn.send(samples)


class HealthProbe:
    """``/health`` every 20 ms from another process (the benchmark's own GIL cannot delay it)."""

    def __init__(self, url: str, interval: float = 0.02):
        ctx = multiprocessing.get_context("spawn")
        self._stop = ctx.Event()
        self._recv, send = ctx.Pipe(duplex=False)
        self._proc = ctx.Process(target=_poll_health, args=(url, self._stop, send, interval), daemon=True)
        self._proc.start()
        self.samples: list[tuple] = []

    def stop(self) -> list[tuple]:
        self._stop.set()
        self.samples = self._recv.recv()
        self._proc.join(10)
        return self.samples


def health_summary(samples, start: float | None = None, end: float | None = None) -> dict:
    xs = [s for s in samples if (start is None or s[0] >= start) and (end is None or s[0] <= end)]
    lat = sorted(1e3 * s[1] for s in xs)
    if not lat:
        return {"n": 0}
    return {"n": len(lat), "median_ms": round(statistics.median(lat), 1),
            "p99_ms": round(lat[min(len(lat) - 1, int(0.99 * len(lat)))], 1), "max_ms": round(lat[-1], 1),
            "statuses": dict(Counter(str(s[2]) for s in xs))}


# ---- client traffic ---------------------------------------------------------------------------------

def prompt_text(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words))


def one_request(c: httpx.Client, body: dict, stream: bool) -> dict:
    """Send one request; what came back, classified ok / refused / lost."""
    rec = {"t0": time.time(), "stream": stream}
    try:
        if stream:
            events = []
            with c.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
                rec["status"] = r.status_code
                rec["retry_after"] = r.headers.get("retry-after")
                if r.status_code != 200:
                    r.read()
                    rec["outcome"] = "refused" if _is_error_json(r.text) else "lost"
                    rec["error"] = json.loads(r.text)["error"].get("code") if rec["outcome"] == "refused" else None
                    rec["t1"] = time.time()
                    return rec
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        events.append(line[6:])
            done = bool(events) and events[-1] == "[DONE]"
            errors = [e for e in events if e.startswith('{"error"')]
            rec["text"] = "".join(json.loads(e)["choices"][0]["text"] for e in events
                                  if e.startswith("{") and '"choices"' in e and json.loads(e)["choices"])
            if errors and done:
                rec["outcome"], rec["error"] = "refused", json.loads(errors[-1])["error"].get("code")
            else:
                rec["outcome"] = "ok" if done else "lost"
        else:
            r = c.post("/v1/completions", json=body)
            rec["status"] = r.status_code
            rec["retry_after"] = r.headers.get("retry-after")
            if r.status_code == 200:
                rec["outcome"], rec["text"] = "ok", r.json()["choices"][0]["text"]
            else:
                rec["outcome"] = "refused" if _is_error_json(r.text) else "lost"
                rec["error"] = r.json()["error"].get("code") if rec["outcome"] == "refused" else r.text[:200]
    except httpx.HTTPError as exc:
        rec["outcome"], rec["error"] = "lost", f"{type(exc).__name__}: {exc}"[:200]
    rec["t1"] = time.time()
    return rec


def _is_error_json(text: str) -> bool:
    try:
        return isinstance(json.loads(text).get("error"), dict)
    except (ValueError, AttributeError):
        return False


class Traffic:
    """``clients`` threads sending small requests (alternately streamed) until stopped."""

    def __init__(self, url: str, model: str, clients: int = 2, words: int = 24, max_tokens: int = 8,
                 seed: int = 0, unique: bool = False):
        self.records: list[dict] = []
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run, args=(url, model, i, words, max_tokens, seed, unique),
                                          daemon=True) for i in range(clients)]
        for t in self._threads:
            t.start()

    def _run(self, url, model, i, words, max_tokens, seed, unique) -> None:
        rng = random.Random(seed * 1000 + i)
        shared = [prompt_text(random.Random(seed + k), words) for k in range(4)]
        with httpx.Client(base_url=url, timeout=120) as c:
            n = 0
            while not self._stop.is_set() and n < 100_000:
                text = prompt_text(rng, words) if unique else rng.choice(shared) + " " + prompt_text(rng, 4)
                body = {"model": model, "prompt": text, "max_tokens": max_tokens, "temperature": 0,
                        "ignore_eos": True}
                rec = one_request(c, body, stream=n % 2 == 1)
                self.records.append(rec)
                if rec["outcome"] != "ok":
                    time.sleep(0.1)   # as a client honouring Retry-After would, without waiting it out
                n += 1

    def stop(self) -> list[dict]:
        self._stop.set()
        for t in self._threads:
            t.join(180)
        return self.records


def traffic_summary(records: list[dict], fault_at: float | None = None) -> dict:
    out = {"requests": len(records), "outcomes": dict(Counter(r["outcome"] for r in records)),
           "statuses": dict(Counter(str(r.get("status")) for r in records)),
           "lost": sum(r["outcome"] == "lost" for r in records)}
    bad = [r for r in records if r["outcome"] != "ok"]
    if fault_at is not None and bad:
        out["first_error_after_fault_s"] = round(min(r["t1"] for r in bad) - fault_at, 3)
        last_bad = max(r["t1"] for r in bad)
        good_after = [r["t0"] for r in records if r["outcome"] == "ok" and r["t0"] >= last_bad]
        out["recovered_after_fault_s"] = round(min(good_after) - fault_at, 3) if good_after else None
    refused = [r for r in records if r["outcome"] == "refused" and r.get("status") == 503]
    if refused:
        out["refused_503_with_retry_after"] = sum(r.get("retry_after") is not None for r in refused)
    if bad:
        out["errors"] = dict(Counter(str(r.get("error")) for r in bad))
    return out


# ---- cases ------------------------------------------------------------------------------------------

@contextmanager
def small_tmpfs(path: Path, size: str):
    """Yields True when a tmpfs of ``size`` is mounted at ``path`` (unmounted afterwards)."""
    path.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                          capture_output=True, check=False)
    try:
        yield done.returncode == 0
    finally:
        if done.returncode == 0:
            subprocess.run(["umount", "--lazy", str(path)], check=False)


def case_disk_full(args, work: Path) -> dict:
    disk = work / "tmpfs"
    with small_tmpfs(disk, "3m") as mounted:
        env = {} if mounted else {"FAULT_DISK_CAP": f"{3 << 20}:{disk}"}
        srv = Server(args.model, args.port, ["--cache-memory", str(6 << 20), "--host-cache-memory", "1M",
                                             "--disk-cache-dir", str(disk)], work / "disk_full.log", env)
        try:
            probe = HealthProbe(srv.url)
            t0 = time.time()
            traffic = Traffic(srv.url, args.model, clients=2, words=160, max_tokens=16, unique=True)
            time.sleep(args.seconds)
            records = traffic.stop()
            samples = probe.stop()
            tier = metrics_matching(srv.url, "flashlane:disk_cache_state")
            errors = metrics_matching(srv.url, "flashlane:prefix_cache_disk_errors")
            used = metric(srv.url, "flashlane:disk_cache_bytes_used")
            alive = health_status(srv.url) == 200
        finally:
            stop = srv.stop()
    return {"how": "3 MB tmpfs" if mounted else "3 MB cap through an injected writer", "started_at": t0,
            "traffic": traffic_summary(records, t0), "health": health_summary(samples),
            "engine_alive_after": alive, "disk_tier_state": tier, "disk_errors": errors,
            "disk_bytes_used": used, "shutdown": stop,
            "log_lines_about_disk": sum("disk" in line.lower() for line in srv.log().splitlines())}


def _replay(url: str, model: str, prompts: list[str], max_tokens: int = 8, timeout: float = 120) -> list[dict]:
    with httpx.Client(base_url=url, timeout=timeout) as c:
        return [one_request(c, {"model": model, "prompt": p, "max_tokens": max_tokens, "temperature": 0,
                                "ignore_eos": True}, stream=False) for p in prompts]


def _tamper(files: list[Path]) -> dict:
    made = Counter()
    for i, f in enumerate(sorted(files)):
        kind = ("directory", "fifo", "unreadable", "intact")[i % 4]
        if kind == "directory":
            f.unlink()
            f.mkdir()
        elif kind == "fifo":
            f.unlink()
            os.mkfifo(f)
        elif kind == "unreadable":
            f.chmod(0)
        made[kind] += 1
    return dict(made)


def case_special_files(args, work: Path) -> dict:
    disk = work / "disk"
    rng = random.Random(7)
    prompts = [prompt_text(rng, 120) for _ in range(12)]
    flags = ["--disk-cache-dir", str(disk)]
    env = {"FAULT_ROOT_PERMISSIONS": str(disk)} if os.geteuid() == 0 else {}
    first = Server(args.model, args.port, flags, work / "special_a.log", env)
    try:
        reference = _replay(first.url, args.model, prompts)
    finally:
        first_stop = first.stop()
    files = [f for f in disk.rglob("*.st") if f.is_file()]
    srv = Server(args.model, args.port, flags, work / "special_b.log", env)
    try:
        made = _tamper(files)
        probe = HealthProbe(srv.url)
        t0 = time.time()
        again = _replay(srv.url, args.model, prompts)
        samples = probe.stop()
        counters = metrics_matching(srv.url, "flashlane:prefix_cache_disk")
        hits = metrics_matching(srv.url, "flashlane:prefix_cache_hits_by_tier")
        stop = srv.stop()
    finally:
        if srv.proc.poll() is None:
            srv.stop()
    mismatches = sum(a.get("text") != b.get("text") for a, b in zip(reference, again))
    return {"files_written_by_first_server": len(files), "tampered": made, "first_shutdown": first_stop,
            "reference": traffic_summary(reference), "after_tampering": traffic_summary(again, t0),
            "output_mismatches": mismatches, "slowest_request_s": round(max(r["t1"] - r["t0"] for r in again), 2),
            "health": health_summary(samples), "disk_counters": counters, "hits_by_tier": hits,
            "shutdown_with_directory_in_the_way": stop,
            "tracebacks_in_log": srv.log().count("Traceback")}


def _read_stream(url: str, body: dict, out: dict, first_token: threading.Event) -> None:
    events = []
    try:
        with httpx.stream("POST", url + "/v1/completions", json={**body, "stream": True}, timeout=120) as r:
            out["status"] = r.status_code
            for line in r.iter_lines():
                if line.startswith("data: "):
                    events.append(line[6:])
                    first_token.set()
    except httpx.HTTPError as exc:
        out["transport_error"] = type(exc).__name__
    first_token.set()
    out["events"] = len(events)
    out["last_events"] = [e[:160] for e in events[-2:]]
    out["ended_with_done"] = bool(events) and events[-1] == "[DONE]"
    out["error_event"] = any(e.startswith('{"error"') for e in events[-2:])


def _post(url: str, body: dict, out: dict) -> None:
    try:
        r = httpx.post(url + "/v1/completions", json=body, timeout=120)
        out.update(status=r.status_code, json_error=_is_error_json(r.text), body=r.text[:200])
    except httpx.HTTPError as exc:
        out["transport_error"] = type(exc).__name__


def case_shutdown_deadline(args, work: Path) -> dict:
    srv = Server(args.model, args.port, ["--shutdown-timeout", "3"], work / "shutdown.log")
    body = {"model": args.model, "prompt": "tell a long story", "max_tokens": 400, "temperature": 0,
            "ignore_eos": True}
    streams = [{} for _ in range(3)]
    blocking = [{} for _ in range(2)]
    started = [threading.Event() for _ in streams]
    threads = [threading.Thread(target=_read_stream, args=(srv.url, body, s, e)) for s, e in zip(streams, started)]
    threads += [threading.Thread(target=_post, args=(srv.url, body, b)) for b in blocking]
    for t in threads:
        t.start()
    for e in started:
        e.wait(120)
    stop = srv.stop(signal.SIGTERM)
    for t in threads:
        t.join(120)
    log = srv.log()
    return {"streams": streams, "non_streaming": blocking, "shutdown": stop,
            "tracebacks_in_log": log.count("Traceback"),
            "shutdown_log_lines": [line for line in log.splitlines() if "shutdown deadline" in line][:10]}


def _large_body(vocab: int, prompts: int = 1000, tokens: int = 15_000) -> bytes:
    rng = random.Random(3)
    rows = [",".join(str(rng.randrange(1, vocab)) for _ in range(tokens)) for _ in range(prompts)]
    return ('{"prompt": [[' + "],[".join(rows) + ']], "max_tokens": 4, "temperature": 0}').encode()


def case_large_bodies(args, work: Path) -> dict:
    srv = Server(args.model, args.port, ["--max-model-len", "16384", "--max-seqs-per-request", "1000",
                                         "--cache-memory", str(1 << 30)], work / "large_bodies.log")
    try:
        body = _large_body(vocab=10)   # one-digit ids: 30 MB, under the default 32 MiB body limit
        probe = HealthProbe(srv.url)
        traffic = Traffic(srv.url, args.model, clients=1, max_tokens=16)
        time.sleep(3)
        rss_before = srv.rss_mib()
        t_send = time.time()
        answer = {}
        try:  # the client gives up after 8 s of waiting: the server sees it disconnect
            r = httpx.post(srv.url + "/v1/completions", content=body, headers={"content-type": "application/json"},
                           timeout=httpx.Timeout(60, read=8))
            answer["status"] = r.status_code
        except httpx.ReadTimeout:
            answer["status"] = "client disconnected"
        t_disconnect = time.time()
        time.sleep(10)
        records = traffic.stop()
        samples = probe.stop()
        rss_after = srv.rss_mib()
        alive = health_status(srv.url) == 200
        stop = srv.stop()
    finally:
        if srv.proc.poll() is None:
            srv.stop()
    return {"body_mib": round(len(body) / 2**20, 1), "answer": answer,
            "health_before": health_summary(samples, end=t_send),
            "health_admission": health_summary(samples, t_send, t_disconnect),
            "health_abort": health_summary(samples, t_disconnect),
            "traffic": traffic_summary(records), "rss_before_mib": round(rss_before, 1),
            "rss_after_10s_mib": round(rss_after, 1), "rss_change": round(rss_after / rss_before - 1, 3),
            "engine_alive_after": alive, "shutdown": stop}


def case_engine_sigkill(args, work: Path) -> dict:
    srv = Server(args.model, args.port, [], work / "sigkill.log")
    try:
        probe = HealthProbe(srv.url)
        traffic = Traffic(srv.url, args.model, clients=2)
        time.sleep(3)
        pid = srv.engine_pid()
        t_kill = time.time()
        os.kill(pid, signal.SIGKILL)
        wait_until(lambda: health_status(srv.url) != 200, 30, "engine death seen")
        back = wait_until(lambda: health_status(srv.url) == 200, 900, "engine restart")
        recovered_s = back - time.monotonic() + time.time() - t_kill
        time.sleep(5)
        records = traffic.stop()
        samples = probe.stop()
        restarts = metric(srv.url, "flashlane:engine_restarts_total")
        stop = srv.stop()
    finally:
        if srv.proc.poll() is None:
            srv.stop()
    in_flight = [r for r in records if r["t0"] <= t_kill <= r["t1"]]
    others = [r for r in records if r not in in_flight]
    return {"cold_start_s": round(srv.cold_start_s, 2), "recovered_s": round(recovered_s, 2),
            "recovery_over_cold_start": round(recovered_s / srv.cold_start_s, 2), "engine_restarts": restarts,
            "in_flight_at_kill": traffic_summary(in_flight), "other_requests": traffic_summary(others, t_kill),
            "health_before_kill": health_summary(samples, end=t_kill),
            "health_states": dict(Counter(str(s[3]) for s in samples)), "shutdown": stop,
            "death_logged": [line for line in srv.log().splitlines() if "engine" in line.lower()
                             and ("died" in line.lower() or "sigkill" in line.lower())][:5]}


CASES = {"disk_full": case_disk_full, "special_files": case_special_files,
         "shutdown_deadline": case_shutdown_deadline, "large_bodies": case_large_bodies,
         "engine_sigkill": case_engine_sigkill}


def goals(results: dict) -> dict:
    """The issue's goals, case by case (None where a case did not run)."""
    g = {}
    if d := results.get("disk_full"):
        g["disk_full: engine alive, 0 lost, /health < 100 ms"] = (
            d["engine_alive_after"] and d["traffic"]["lost"] == 0 and d["health"]["max_ms"] < HEALTH_GOAL_MS)
    if s := results.get("special_files"):
        g["special_files: 0 mismatches, 0 lost, all 200, /health < 100 ms"] = (
            s["output_mismatches"] == 0 and s["after_tampering"]["lost"] == 0
            and s["after_tampering"]["outcomes"].get("ok") == s["after_tampering"]["requests"]
            and s["health"]["max_ms"] < HEALTH_GOAL_MS)
    if s := results.get("shutdown_deadline"):
        g["shutdown_deadline: every stream ends with [DONE], non-streaming get 503 JSON, no traceback"] = (
            all(x.get("ended_with_done") for x in s["streams"])
            and all(x.get("status") == 503 and x.get("json_error") for x in s["non_streaming"])
            and s["tracebacks_in_log"] == 0)
    if s := results.get("large_bodies"):
        g["large_bodies: /health < 100 ms, 0 lost"] = (
            max(s["health_admission"].get("max_ms", 0), s["health_abort"].get("max_ms", 0)) < HEALTH_GOAL_MS
            and s["traffic"]["lost"] == 0)
    if s := results.get("engine_sigkill"):
        g["engine_sigkill: back within 2x cold start, 0 lost outside the in-flight ones"] = (
            s["recovery_over_cold_start"] <= 2.0 and s["other_requests"]["lost"] == 0)
    return g


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="tiny-flash")
    ap.add_argument("--port", type=int, default=18400)
    ap.add_argument("--cases", default=",".join(CASES), help="comma-separated: " + ", ".join(CASES))
    ap.add_argument("--seconds", type=float, default=25.0, help="traffic time of the disk_full case")
    ap.add_argument("--out")
    args = ap.parse_args()
    names = [c for c in args.cases.split(",") if c]
    unknown = [c for c in names if c not in CASES]
    if unknown:
        ap.error(f"unknown case(s) {unknown}; known: {', '.join(CASES)}")
    results: dict = {"model": args.model, "load_average_before": os.getloadavg(), "cases": {}}
    with tempfile.TemporaryDirectory(prefix="flashlane-faults-") as tmp:
        for name in names:
            work = Path(tmp) / name
            work.mkdir()
            t0 = time.monotonic()
            try:
                results["cases"][name] = CASES[name](args, work)
            except Exception as exc:  # a case that could not run is a result, not a crash
                traceback.print_exc()
                results["cases"][name] = {"failed": f"{type(exc).__name__}: {exc}"}
            results["cases"][name]["case_s"] = round(time.monotonic() - t0, 1)
            print(f"{name}: done in {time.monotonic() - t0:.0f} s", file=sys.stderr, flush=True)
    results["load_average_after"] = os.getloadavg()
    results["goals"] = goals({k: v for k, v in results["cases"].items() if "failed" not in v})
    write_result("faults", results, args.out)


if __name__ == "__main__":
    main()
