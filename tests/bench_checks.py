"""Consistency checks shared by the bench integration tests (records vs summary)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from flashlane.bench.recompute import recompute_summary
from flashlane.bench.records import read_requests, read_sessions

REQUIRED_REQUEST_KEYS = {"request_id", "session_id", "status", "send_time", "first_token_time",
                         "end_time", "input_tokens", "output_tokens"}
REQUIRED_BLOCKS = ("ttft_s", "tpot_s", "e2e_s", "task_latency_s")
STATS = ("n", "mean", "std", "min", "max", "p50", "p75", "p90", "p95", "p99")


def check_run(run_dir: Path, source=None, mode: str = "recorded") -> tuple[dict, list, list]:
    run_dir = Path(run_dir)
    for f in ("manifest.json", "requests.jsonl", "sessions.jsonl", "summary.json", "report.md",
              "report.html"):
        assert (run_dir / f).is_file(), f
    s = json.loads((run_dir / "summary.json").read_text())
    lines = [json.loads(x) for x in (run_dir / "requests.jsonl").read_text().splitlines()]
    for line in lines:
        assert REQUIRED_REQUEST_KEYS <= set(line)
    recs = read_requests(run_dir / "requests.jsonl")
    sess = read_sessions(run_dir / "sessions.jsonl")
    # schema
    for k in ("schema_version", "window_s", "tasks_per_hour"):
        assert k in s
    assert {"completed", "failed"} <= set(s["requests"]) and "completed" in s["sessions"]
    for b in REQUIRED_BLOCKS:
        assert set(STATS) <= set(s[b]), b
    # every request is recorded exactly once
    assert len({r.request_id for r in recs}) == len(recs)
    prof = [r for r in recs if r.phase == "profiling"]
    assert s["requests"]["sent"] == len(prof)
    assert s["requests"]["completed"] + s["requests"]["failed"] == len(prof)
    assert s["requests"]["warmup"] == len(recs) - len(prof)
    assert s["errors"]["total"] == sum(1 for r in prof if not r.ok)
    assert sum(s["errors"]["by_class"].values()) == s["errors"]["total"]
    # complete trees sent every request of their trace
    if source is not None:
        by_tree = {}
        for r in prof:
            by_tree.setdefault(r.tree_id, []).append(r)
        for t in sess:
            if t.completed and not t.truncated:
                trace = source.trace(int(t.tree_id[1:]))
                assert len(by_tree[t.tree_id]) == trace.num_requests == t.num_requests
    # percentiles equal numpy's on the records
    ok = [r for r in prof if r.ok]
    ttft = np.array([r.first_token_time - r.send_time for r in ok])
    e2e = np.array([(r.last_token_time or r.end_time) - r.send_time for r in ok])
    tpot = np.array([((r.last_token_time or r.end_time) - r.first_token_time) / (r.output_tokens - 1)
                     for r in ok if r.output_tokens and r.output_tokens > 1])
    tasks = [t for t in sess if t.phase == "profiling" and t.completed and not t.truncated]
    lat = np.array([t.end_time - t.start_time for t in tasks])
    for name, arr in (("ttft_s", ttft), ("e2e_s", e2e), ("tpot_s", tpot), ("task_latency_s", lat)):
        assert s[name]["n"] == arr.size, name
        if arr.size:
            for p in (50, 75, 90, 95, 99):
                assert s[name][f"p{p}"] == pytest.approx(np.percentile(arr, p), rel=1e-12), (name, p)
            assert s[name]["mean"] == pytest.approx(arr.mean(), rel=1e-12)
            assert s[name]["std"] == pytest.approx(arr.std(), rel=1e-9, abs=1e-15)
    # tasks/hour = completed sessions over the window
    assert s["sessions"]["completed"] == len(tasks)
    assert s["tasks_per_hour"] == pytest.approx(len(tasks) / s["window_s"] * 3600.0)
    assert all(s["window_start"] <= t.start_time and t.end_time <= s["window_end"] for t in tasks)
    if mode == "recorded":
        assert ok and all(r.output_tokens == r.requested_output_tokens for r in ok)
        assert s["requests"]["incomplete_outputs"] == 0
    # the summary is recomputable from the records
    again = recompute_summary(run_dir)
    for k, v in again.items():
        if k != "validity":
            assert s[k] == v, k
    return s, recs, sess
