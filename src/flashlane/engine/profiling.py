"""Where engine steps spend their time, per layer type, from torch.profiler and the models' named ranges.

Every range of ``trace_ranges.RANGE_NAMES`` is charged its *own* time: its wall time less
that of the named ranges nested in it (a DSA layer's indexer is charged to ``indexer``, not also
to ``dsa_attention``), so the categories add up to the profiled steps' wall time with nothing
counted twice. Two ranges have their own time renamed: ``engine_step`` -> ``engine_overhead``
(scheduling, batch building, bookkeeping, detokenising: the step outside the model and the
sampler) and ``model_forward`` -> ``model_other`` (glue between the layers). Aten ops are
counted as issued by Python, i.e. those not nested in another aten op, each charged to the
range it ran in: the eager-dispatch load.

``StepProfiler`` is one profiling window (``flashlane profile`` drives it; the server opens one
per ``/start_profile`` .. ``/stop_profile`` on its stepping thread, which is the thread
torch.profiler records).
"""

from __future__ import annotations

import itertools
import json
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from ..trace_ranges import RANGE_NAMES, set_profiling

OWN_TIME_NAME = {"engine_step": "engine_overhead", "model_forward": "model_other"}
CATEGORIES = tuple(OWN_TIME_NAME.get(n, n) for n in RANGE_NAMES)
_NAMED = frozenset(RANGE_NAMES)


def _duration_us(e) -> float:
    return e.time_range.end - e.time_range.start


def _enclosing_range(e):
    """The nearest named range ``e`` runs inside (None: outside all of them)."""
    p = e.cpu_parent
    while p is not None and p.name not in _NAMED:
        p = p.cpu_parent
    return p


def breakdown(events) -> dict:
    """Per-category own time, aten ops and range entries over torch.profiler ``events``
    (``prof.events()``); ``steps``: the ``engine_step`` ranges among them; ``between_steps_ms``:
    the time from the first step's start to the last one's end spent outside steps (an idle or
    busy-elsewhere engine thread)."""
    own_us = dict.fromkeys(RANGE_NAMES, 0.0)
    ops = dict.fromkeys(RANGE_NAMES, 0)
    calls = dict.fromkeys(RANGE_NAMES, 0)
    unattributed_ops = 0
    step_spans = []
    for e in events:
        if e.name in _NAMED:
            d = _duration_us(e)
            own_us[e.name] += d
            calls[e.name] += 1
            if e.name == "engine_step":
                step_spans.append((e.time_range.start, e.time_range.end))
            outer = _enclosing_range(e)
            if outer is not None:
                own_us[outer.name] -= d
        elif e.name.startswith("aten::") and not (e.cpu_parent is not None and e.cpu_parent.name.startswith("aten::")):
            outer = _enclosing_range(e)
            if outer is None:
                unattributed_ops += 1
            else:
                ops[outer.name] += 1
    rows = {OWN_TIME_NAME.get(n, n): {"ms": own_us[n] / 1000, "aten_ops": ops[n], "calls": calls[n]}
            for n in RANGE_NAMES}
    total_ms = sum(r["ms"] for r in rows.values())
    for r in rows.values():
        r["share"] = r["ms"] / total_ms if total_ms > 0 else 0.0
    span_us = max(s[1] for s in step_spans) - min(s[0] for s in step_spans) if step_spans else 0.0
    in_steps_us = sum(end - start for start, end in step_spans)
    return {"steps": len(step_spans), "total_ms": total_ms, "between_steps_ms": (span_us - in_steps_us) / 1000,
            "aten_ops": sum(ops.values()), "aten_ops_outside_ranges": unattributed_ops, "categories": rows}


def per_unit(summary: dict, units: int | None = None) -> dict:
    """``breakdown`` divided by ``units`` (default: its steps), e.g. per decode step or per prompt."""
    n = max(summary["steps"] if units is None else units, 1)
    cats = {k: {"ms": v["ms"] / n, "share": v["share"], "aten_ops": v["aten_ops"] / n, "calls": v["calls"] / n}
            for k, v in summary["categories"].items()}
    return {"steps": summary["steps"], "ms": summary["total_ms"] / n, "aten_ops": summary["aten_ops"] / n,
            "aten_ops_outside_ranges": summary["aten_ops_outside_ranges"] / n,
            "between_steps_ms": summary["between_steps_ms"] / n, "categories": cats}


class StepProfiler:
    """One torch.profiler window with the named ranges on. ``start`` and ``stop`` must run on
    the thread that runs the engine steps."""

    def __init__(self):
        self._prof: profile | None = None

    @property
    def active(self) -> bool:
        return self._prof is not None

    def start(self) -> None:
        if self._prof is not None:
            raise RuntimeError("a profiling window is already open")
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
        prof = profile(activities=activities)
        set_profiling(True)
        try:
            prof.start()
        except BaseException:
            set_profiling(False)
            raise
        self._prof = prof

    def stop(self) -> profile:
        """Close the window; the returned profile can be summarised and exported on any thread."""
        if self._prof is None:
            raise RuntimeError("no profiling window is open")
        prof, self._prof = self._prof, None
        try:
            prof.stop()
        finally:
            set_profiling(False)
        return prof


def write_trace(prof: profile, path: str | Path) -> Path:
    """The window as a Chrome / Perfetto trace (chrome://tracing, ui.perfetto.dev)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    prof.export_chrome_trace(str(path))
    return path


_window_numbers = itertools.count()


def write_window(prof: profile, directory: str | Path) -> dict:
    """A closed live window into ``directory``: the trace and its per-layer-type summary beside
    it; returns both paths with the summary's headline numbers."""
    directory = Path(directory)
    stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime())
    stem = f"flashlane-{stamp}-{next(_window_numbers)}"
    trace = write_trace(prof, directory / f"{stem}.trace.json")
    summary = per_unit(breakdown(prof.events()))
    summary_path = directory / f"{stem}.profile.json"
    summary_path.write_text(json.dumps(summary, indent=2))
    return {"trace": str(trace), "summary": str(summary_path), "steps": summary["steps"],
            "ms_per_step": summary["ms"], "ms_between_steps": summary["between_steps_ms"]}


__all__ = ["CATEGORIES", "StepProfiler", "breakdown", "per_unit", "write_trace", "write_window"]
