"""Recompute a run's summary offline from its records (requests.jsonl, sessions.jsonl) and the
window and parameters stored in manifest.json."""

from __future__ import annotations

import json
from pathlib import Path

from .metrics import SummaryParams, compute_summary
from .prefix_reuse import DEFAULT_PAGE_SIZE
from .records import read_requests, read_sessions


def recompute_summary(run_dir: str | Path) -> dict:
    d = Path(run_dir)
    m = json.loads((d / "manifest.json").read_text())
    lp = m["load_point"]
    params = SummaryParams(concurrency=lp.get("concurrency"), request_rate=lp.get("request_rate"),
                           mode=m["mode"], slo=m.get("slo") or {},
                           max_error_rate=m.get("max_error_rate", 0.01),
                           cancelled=bool(m.get("cancelled")),
                           abort_reason=m.get("abort_reason"), n_boot=m.get("n_boot", 1000),
                           seed=m.get("seed", 0), page_size=m.get("page_size", DEFAULT_PAGE_SIZE))
    return compute_summary(read_requests(d / "requests.jsonl"), read_sessions(d / "sessions.jsonl"),
                           m["window_start"], m["window_end"], params)
