"""Idle-gap detection on a utilisation timeline and attribution from client records.

A gap is a maximal run of utilisation samples below `threshold` lasting >= `min_gap_s` (sample i
covers the period since sample i-1). Each gap is split by what the client and server were doing:
  A  workload idle  - no request in flight (think / tool time; inherent at concurrency 1)
  B  stack bubble   - requests in flight, device idle, nothing queued in the engine
  C  queue          - requests in flight and the engine reports waiting requests
and labelled with the class holding most of its time.

Against a flashlane server the timeline is the engine's own step records (``/debug/steps``):
busy means inside a step, a gap is the time between two steps, and "queued" means the step
before the gap left requests waiting. CPU% and NVML samples (the fallback for other servers)
are distorted by co-tenants and too coarse for sub-second bubbles; step records are neither.
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right

import numpy as np

CLASSES = ("A", "B", "C")
CLASS_NAMES = {"A": "workload idle (nothing in flight)", "B": "stack bubble (in flight, device idle)",
               "C": "queue (requests waiting in the engine)"}


def merge_intervals(intervals):
    out = []
    for s, e in sorted(intervals):
        if out and s <= out[-1][1]:
            out[-1][1] = max(out[-1][1], e)
        else:
            out.append([s, e])
    return [(s, e) for s, e in out]


def overlap(merged, s, e) -> float:
    return sum(max(0.0, min(b, e) - max(a, s)) for a, b in merged)


def detect_gaps(times, values, threshold: float = 0.05, min_gap_s: float = 0.2):
    """[(start, end)] of idle runs; values are busy fractions in [0, 1]."""
    if len(times) != len(values):
        raise ValueError("times/values: lengths differ")
    gaps, start = [], None
    for i in range(1, len(times)):
        idle = values[i] < threshold
        if idle and start is None:
            start = times[i - 1]
        if not idle and start is not None:
            if times[i - 1] - start >= min_gap_s:
                gaps.append((start, times[i - 1]))
            start = None
    if start is not None and times[-1] - start >= min_gap_s:
        gaps.append((start, times[-1]))
    return gaps


def _attribute(s: float, e: float, merged, queued: bool) -> dict:
    length = e - s
    busy = overlap(merged, s, e)
    parts = {"A": max(0.0, length - busy), "B": 0.0 if queued else busy, "C": busy if queued else 0.0}
    cls = max(CLASSES, key=lambda c: parts[c])
    return {"start": s, "end": e, "duration_s": length, "cls": cls,
            "a_s": parts["A"], "b_s": parts["B"], "c_s": parts["C"]}


def classify_gaps(gaps, in_flight_intervals, waiting=(), waiting_tolerance_s: float = 0.5):
    """Attribute each gap; `waiting` = [(t, num_requests_waiting)] scraped from the server."""
    merged = merge_intervals(in_flight_intervals)
    wt = sorted(waiting)
    w_times = [t for t, _ in wt]
    out = []
    for s, e in gaps:
        lo = bisect_left(w_times, s - waiting_tolerance_s)
        hi = bisect_right(w_times, e + waiting_tolerance_s)
        out.append(_attribute(s, e, merged, any(v > 0 for _, v in wt[lo:hi])))
    return out


def step_gaps(steps, in_flight_intervals, ws: float, we: float, min_gap_s: float = 0.2):
    """Classified idle gaps of ``[ws, we]`` from engine steps ``[(start, end, num_waiting_after)]``
    on the client's clock, in step order. A gap is the time between two steps (or a window edge
    and a step) lasting >= ``min_gap_s``; it is queued (C) when the step before it left requests
    waiting: only a step admits, so they waited through the whole gap."""
    merged = merge_intervals(in_flight_intervals)
    out = []
    prev_end, waiting = ws, 0
    for start, end, num_waiting in [*steps, (we, we, 0)]:
        s, e = max(prev_end, ws), min(start, we)
        if e - s >= min_gap_s:
            out.append(_attribute(s, e, merged, waiting > 0))
        if end > prev_end:
            prev_end, waiting = end, num_waiting
    return out


def step_busy_fractions(steps, in_flight_intervals, ws: float, we: float) -> dict:
    """Time inside a step over the window, and over the time something was in flight."""
    busy = merge_intervals([(max(s, ws), min(e, we)) for s, e, _ in steps if e > ws and s < we])
    in_flight = merge_intervals([(max(s, ws), min(e, we)) for s, e in in_flight_intervals if e > ws and s < we])
    busy_s = sum(e - s for s, e in busy)
    in_flight_s = sum(e - s for s, e in in_flight)
    return {"overall": busy_s / (we - ws) if we > ws else None,
            "when_in_flight": (sum(overlap(busy, s, e) for s, e in in_flight) / in_flight_s
                               if in_flight_s > 0 else None),
            "steps": len(steps)}


def step_series(steps) -> tuple[list[float], list[float]]:
    """Steps as a square wave to plot: 1 inside a step, 0 between steps."""
    times, values = [], []
    for s, e, _ in steps:
        times += [s, s, e, e]
        values += [0.0, 1.0, 1.0, 0.0]
    return times, values


def summarize_gaps(gaps, window_s: float | None = None) -> dict:
    edges = [0.2, 0.5, 1, 2, 5, 10, 30, float("inf")]
    out = {"count": len(gaps), "total_s": float(sum(g["duration_s"] for g in gaps)), "by_class": {}}
    for c in CLASSES:
        gs = [g for g in gaps if g["cls"] == c]
        d = [g["duration_s"] for g in gs]
        out["by_class"][c] = {
            "name": CLASS_NAMES[c], "count": len(gs), "total_s": float(sum(d)),
            "time_s": float(sum(g[f"{c.lower()}_s"] for g in gaps)),
            "mean_s": float(np.mean(d)) if d else None, "max_s": float(max(d)) if d else None,
            "histogram": {f"<{hi:g}s": sum(1 for x in d if lo <= x < hi)
                          for lo, hi in zip([0] + edges[:-1], edges)}}
    if window_s:
        out["idle_fraction"] = out["total_s"] / window_s
    return out


def busy_fractions(times, values, in_flight_intervals) -> dict:
    """Mean utilisation over the timeline, and over samples whose period was mostly in flight."""
    if len(times) < 2:
        return {"overall": None, "when_in_flight": None, "samples": len(times)}
    merged = merge_intervals(in_flight_intervals)
    v = np.asarray(values[1:], dtype=float)
    dt = np.diff(np.asarray(times, dtype=float))
    infl = np.array([overlap(merged, times[i - 1], times[i]) / max(dt[i - 1], 1e-12) > 0.5
                     for i in range(1, len(times))])
    overall = float(np.average(v, weights=dt)) if dt.sum() > 0 else None
    when = float(np.average(v[infl], weights=dt[infl])) if infl.any() and dt[infl].sum() > 0 else None
    return {"overall": overall, "when_in_flight": when, "samples": len(times)}
