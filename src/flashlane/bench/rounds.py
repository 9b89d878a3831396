"""Interleaved, paired measurement of two targets at one load point.

A load point's sessions are split into rounds (closed loop: one session per lane; open loop: a
few sessions each). Round r replays the same trees on both targets back to back, in the order
A, B on even rounds and B, A on odd ones (ABBA), so drift of the machine's load lands on both
sides alike and each round gives one *pair*: the same tasks under nearly the same conditions.
Both servers stay up throughout; the idle one's CPU time during the other's round is measured,
not assumed to be zero.

Per round and side it records the run folder (a normal bench run: manifest, records, engine
steps), the co-tenant load (`MachineLoad`), the CPU seconds of each server's process tree and,
from the engine's step records, its busy time split into forward, sampling and engine overhead.
`merge_side` then folds one side's rounds into one summary for the tables.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field, replace
from pathlib import Path

import psutil

from .attribution import read_steps, step_split
from .machine_load import MachineLoad
from .metrics import SummaryParams, compute_summary
from .records import read_requests, read_sessions, write_jsonl
from .runner import BenchConfig, run_point
from .task_components import task_latencies

OPEN_LOOP_ROUNDS = 3


@dataclass
class RoundRun:
    index: int                 # round number (0, 1, ...)
    position: int              # place in the whole schedule of this load point (0 = first run)
    side: str                  # target name
    run_dir: Path
    start: float               # bench clock: the round's profiling window
    end: float
    summary: dict
    latencies: list[float]     # measured tasks of this round
    machine: dict              # MachineLoad summary during the round
    cpu_s: dict[str, float | None] = field(default_factory=dict)  # server name -> CPU s of its tree
    engine: dict | None = None  # busy/forward/sample/overhead seconds from the step records

    @property
    def duration_s(self) -> float:
        return max(0.0, self.end - self.start)

    @property
    def tasks(self) -> int:
        return len(self.latencies)

    def to_json(self) -> dict:
        return {"round": self.index, "position": self.position, "side": self.side,
                "folder": str(self.run_dir), "start": self.start, "end": self.end,
                "duration_s": self.duration_s, "tasks": self.tasks, "task_s": self.latencies,
                "machine_load": self.machine, "server_cpu_s": self.cpu_s, "engine": self.engine}


def round_sizes(cfg: BenchConfig, point) -> list[int | None]:
    """Sessions per round: one per lane in closed loop, else the point's sessions in a few rounds.
    A duration-bounded run is one round as configured (None: it cannot be split up front)."""
    control = cfg.control(point)
    n = control.num_sessions
    if control.duration_s is not None or n is None:
        return [None]
    per = point.concurrency if point.concurrency else max(1, math.ceil(n / OPEN_LOOP_ROUNDS))
    sizes = [per] * (n // per)
    if n % per:
        sizes.append(n % per)
    return sizes


def schedule(names: list[str], rounds: int) -> list[tuple[int, str]]:
    """(round, side) in run order: A B, B A, A B, ..."""
    out = []
    for r in range(rounds):
        out += [(r, n) for n in (names if r % 2 == 0 else names[::-1])]
    return out


def _tree_cpu_s(pid: int | None) -> float | None:
    """User + system CPU seconds of a process and its children (an engine process is a child)."""
    if not pid:
        return None
    try:
        root = psutil.Process(pid)
        procs = [root] + root.children(recursive=True)
    except psutil.Error:
        return None
    total = 0.0
    for p in procs:
        try:
            t = p.cpu_times()
            total += t.user + t.system
        except psutil.Error:
            continue
    return total


def engine_time(run_dir: Path, start: float, end: float) -> dict | None:
    """The engine's own time in [start, end] from its step records (written by the run): busy
    (inside a step) and its forward / sampling / overhead split; None for servers without step
    records."""
    steps = read_steps(run_dir)
    if steps is None:
        return None
    out = {"steps": 0, "busy_s": 0.0, "forward_s": 0.0, "sample_s": 0.0, "overhead_s": 0.0}
    for st in steps:
        split = step_split(st, start, end)
        if split is not None:
            out["steps"] += 1
            for key, v in split.items():
                out[key] += v
    return out


def run_round(cfg: BenchConfig, source, synth, point, run_dir: Path, index: int, position: int, side: str,
              first_session: int, sessions: int | None, servers: dict[str, int | None]) -> tuple[RoundRun, int]:
    """One round of one side (`sessions` None: as `cfg` says); returns it and the next free
    session index. Only the first round warms up."""
    rcfg = replace(cfg, first_session=first_session, warmup=cfg.warmup if index == 0 else "none")
    if sessions is not None:
        rcfg = replace(rcfg, num_sessions=sessions)
    before = {name: _tree_cpu_s(pid) for name, pid in servers.items()}
    with MachineLoad([p for p in servers.values() if p]) as load:
        summary = run_point(rcfg, source, synth, point, run_dir)
    after = {name: _tree_cpu_s(pid) for name, pid in servers.items()}
    cpu = {n: (after[n] - before[n]) if after[n] is not None and before[n] is not None else None
           for n in servers}
    machine = load.summary()
    (run_dir / "machine_load.json").write_text(json.dumps(machine, indent=2))
    start, end = summary["window_start"], summary["window_end"]
    rr = RoundRun(index, position, side, run_dir, start, end, summary,
                  task_latencies(read_sessions(run_dir / "sessions.jsonl")), machine, cpu,
                  engine_time(run_dir, start, end))
    return rr, summary.get("_next_session_index", first_session + (sessions or 0))


def merge_side(cfg: BenchConfig, point, rounds: list[RoundRun], folder: Path) -> tuple[dict, list, list]:
    """One summary of a side's rounds: the records pooled, the rate metrics over the side's own
    measured time (the sum of its rounds), telemetry pooled; written to `folder` with the pooled
    records (the rounds keep their own folders). Returns (summary, requests, sessions)."""
    records = [r for rr in rounds for r in read_requests(rr.run_dir / "requests.jsonl")]
    sessions = [s for rr in rounds for s in read_sessions(rr.run_dir / "sessions.jsonl")]
    first = rounds[0].summary
    params = SummaryParams(concurrency=point.concurrency, request_rate=point.request_rate, mode=cfg.mode,
                           slo=cfg.slo, max_error_rate=cfg.max_error_rate, n_boot=cfg.n_boot, seed=cfg.seed,
                           page_size=(first.get("_manifest") or {}).get("page_size") or cfg.page_size or 16,
                           active_s=sum(rr.duration_s for rr in rounds))
    summary = compute_summary(records, sessions, min(rr.start for rr in rounds), max(rr.end for rr in rounds),
                              params)
    summary["telemetry"] = merge_telemetry([rr.summary.get("telemetry") or {} for rr in rounds],
                                           [rr.duration_s for rr in rounds])
    summary["server_info"] = first.get("server_info") or {}
    reasons = [f"round {rr.index}: {x}" for rr in rounds for x in rr.summary["validity"]["reasons"]]
    summary["validity"]["reasons"] += reasons
    summary["validity"]["valid"] = summary["validity"]["valid"] and not reasons
    summary["rounds"] = [rr.to_json() for rr in rounds]
    folder.mkdir(parents=True, exist_ok=True)
    write_jsonl(folder / "requests.jsonl", records)
    write_jsonl(folder / "sessions.jsonl", sessions)
    (folder / "summary.json").write_text(json.dumps(summary, indent=2, default=str))
    summary["_manifest"] = first.get("_manifest")
    return summary, records, sessions


def merge_telemetry(parts: list[dict], weights: list[float]) -> dict:
    """Round telemetry summaries pooled: idle gaps summed, busy fractions and CPU duration-weighted."""
    parts = [(p, w) for p, w in zip(parts, weights) if p.get("enabled")]
    if not parts:
        return {"enabled": False}
    out = {k: v for k, v in parts[0][0].items() if k in ("enabled", "utilisation_source", "idle_gap_source",
                                                         "min_gap_s", "idle_threshold", "gpus", "server_pid")}
    total_w = sum(w for _, w in parts) or 1.0

    def weighted(key):
        vals = [(p[key], w) for p, w in parts if isinstance(p.get(key), (int, float))]
        return sum(v * w for v, w in vals) / sum(w for _, w in vals) if vals and sum(w for _, w in vals) else None

    out["busy_overall"], out["busy_when_in_flight"] = weighted("busy_overall"), weighted("busy_when_in_flight")
    cpus = [(p["server_cpu_percent"]["mean"], w) for p, w in parts if p.get("server_cpu_percent")]
    if cpus:
        out["server_cpu_percent"] = {"mean": sum(v * w for v, w in cpus) / (sum(w for _, w in cpus) or 1.0),
                                     "max": max(p["server_cpu_percent"]["max"] for p, _ in parts
                                                if p.get("server_cpu_percent"))}
    gaps = [p["idle_gaps"] for p, _ in parts if p.get("idle_gaps")]
    if gaps:
        merged = {"count": sum(g["count"] for g in gaps), "total_s": sum(g["total_s"] for g in gaps), "by_class": {}}
        for c, v in gaps[0]["by_class"].items():
            merged["by_class"][c] = {"name": v["name"],
                                     "count": sum(g["by_class"][c]["count"] for g in gaps),
                                     "total_s": sum(g["by_class"][c]["total_s"] for g in gaps),
                                     "time_s": sum(g["by_class"][c].get("time_s", 0.0) for g in gaps)}
        merged["idle_fraction"] = merged["total_s"] / total_w
        out["idle_gaps"] = merged
    out["engine_steps_complete"] = all(p.get("engine_steps_complete", True) for p, _ in parts)
    return out
