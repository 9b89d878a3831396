"""Where a task's time goes, measured: each task's wall-clock interval partitioned by what the
client and the engine were doing, from the client's request records and the engine's step records
(no model of the hardware involved).

Within a task's interval (first request sent .. last response read):
- no request of the task in flight: the scheduled think/tool waits the replay slept, and the rest
  (the client's own turn handling between a response and the next request);
- a request in flight and the engine inside a step: that step's time, split by the step's own
  forward / sampling / engine-overhead shares;
- a request in flight and the engine not stepping: HTTP, tokenisation, the hop to the engine
  process, detokenisation, and waits between steps (class B bubbles).
These parts tile the interval, so they sum to the task's latency up to how well the two clocks
line up (the report shows the difference). At concurrency > 1 a step serves several tasks; each
task's share is its own wall time, which is what its latency is made of.
"""

from __future__ import annotations

import json
from pathlib import Path

from .idle_gaps import merge_intervals
from .records import PHASE_PROFILING, RequestRecord, SessionRecord, read_requests, read_sessions
from .task_components import measured_sessions

COMPONENTS = (("think_s", "think/tool wait (scheduled)"),
              ("client_gap_s", "client between turns"),
              ("forward_s", "engine: model forward"),
              ("sample_s", "engine: sampling"),
              ("overhead_s", "engine: step overhead (scheduling, cache, outputs)"),
              ("not_stepping_s", "in flight, engine not stepping (HTTP, tokenise, IPC, waits)"))


def _clip(intervals, lo: float, hi: float):
    return [(max(s, lo), min(e, hi)) for s, e in intervals if min(e, hi) > max(s, lo)]


def step_split(step: dict, lo: float, hi: float) -> dict | None:
    """The part of one step record inside [lo, hi], split by the step's own shares into model
    forward, sampling and engine overhead (scheduling, cache bookkeeping, outputs); None when
    it lies outside."""
    a, b = max(step["start"], lo), min(step["end"], hi)
    dur = step["end"] - step["start"]
    if b <= a or dur <= 0:
        return None
    model = min(step.get("model_s", 0.0), dur)
    sample = min(step.get("sample_s", 0.0), model)
    share = (b - a) / dur
    return {"busy_s": b - a, "forward_s": share * (model - sample), "sample_s": share * sample,
            "overhead_s": share * (dur - model)}


def task_partition(session: SessionRecord, requests: list[RequestRecord], steps: list[dict]) -> dict:
    """The components of one task (seconds); `steps` on the bench clock, sorted by start."""
    t0, t1 = session.start_time, session.end_time
    in_flight = merge_intervals(_clip([(r.send_time, r.end_time) for r in requests
                                       if r.send_time is not None and r.end_time], t0, t1))
    flight_s = sum(e - s for s, e in in_flight)
    think = sum(r.think_time_s for r in requests)
    out = {"task_s": t1 - t0, "think_s": 0.0, "client_gap_s": 0.0, "forward_s": 0.0, "sample_s": 0.0,
           "overhead_s": 0.0, "not_stepping_s": 0.0}
    between = max(0.0, (t1 - t0) - flight_s)
    out["think_s"] = min(think, between)
    out["client_gap_s"] = between - out["think_s"]
    stepping = 0.0
    for a, b in in_flight:
        for st in steps:
            if st["start"] >= b:
                break
            split = step_split(st, a, b)
            if split is None:
                continue
            for key in ("forward_s", "sample_s", "overhead_s"):
                out[key] += split[key]
            stepping += split["busy_s"]
    out["not_stepping_s"] = max(0.0, flight_s - stepping)
    return out


def read_steps(run_dir: Path) -> list[dict] | None:
    path = run_dir / "telemetry" / "engine_steps.jsonl"
    if not path.exists():
        return None
    steps = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return sorted(steps, key=lambda s: s["start"])


def run_partitions(run_dir: Path) -> list[dict] | None:
    """Every measured task of one run folder, partitioned; None without engine step records."""
    steps = read_steps(run_dir)
    if steps is None:
        return None
    records = read_requests(run_dir / "requests.jsonl")
    by_tree: dict[str, list[RequestRecord]] = {}
    for r in records:
        if r.phase == PHASE_PROFILING and r.ok:
            by_tree.setdefault(r.tree_id, []).append(r)
    return [task_partition(s, by_tree.get(s.tree_id, []), steps)
            for s in measured_sessions(read_sessions(run_dir / "sessions.jsonl"))]


def mean_partition(parts: list[dict]) -> dict | None:
    """Mean of each component over tasks, with the measured task time and the sum of the parts."""
    if not parts:
        return None
    n = len(parts)
    out = {k: sum(p[k] for p in parts) / n for k in ("task_s",) + tuple(k for k, _ in COMPONENTS)}
    out["tasks"] = n
    out["sum_s"] = sum(out[k] for k, _ in COMPONENTS)
    return out
