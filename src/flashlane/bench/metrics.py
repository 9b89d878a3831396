"""Summary metrics, computed only from request/session records and the window (so any summary
can be recomputed offline from requests.jsonl + sessions.jsonl). Failed requests are excluded from
latency statistics and counted in the error block."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import numpy as np

from .prefix_reuse import DEFAULT_PAGE_SIZE, prefix_cache_rates
from .records import PHASE_PROFILING, RequestRecord, SessionRecord
from .stats import bootstrap_ci, describe, in_flight_series, step_time_average

SCHEMA_VERSION = "1.0"


@dataclass
class SummaryParams:
    concurrency: int | None = None
    request_rate: float | None = None
    mode: str = "recorded"
    slo: dict = field(default_factory=dict)  # {"ttft_s": a, "tpot_s": b, "e2e_s": c}
    max_error_rate: float = 0.01
    max_overflow_rate: float = 0.01
    cancelled: bool = False
    abort_reason: str | None = None
    n_boot: int = 1000
    seed: int = 0
    page_size: int = DEFAULT_PAGE_SIZE  # server's prefix-cache page, for the theoretical hit rate
    # seconds this target was measured within the window (interleaved rounds: the sum of its own
    # rounds, the other target's rounds left out); None: the whole window
    active_s: float | None = None

    def __post_init__(self):
        if self.page_size < 1:
            raise ValueError(f"page_size: must be >= 1, got {self.page_size}")
        bad = [k for k in self.slo if k not in ("ttft_s", "tpot_s", "e2e_s")]
        if bad:
            raise ValueError(f"slo: unknown key(s) {bad}; use ttft_s, tpot_s, e2e_s")


def ttft(r: RequestRecord):
    return r.first_token_time - r.send_time if r.first_token_time is not None else None


def ttft_queue(r: RequestRecord):
    return r.first_token_time - r.issue_time if r.first_token_time is not None else None


def e2e(r: RequestRecord):
    return (r.last_token_time or r.end_time) - r.send_time


def e2e_queue(r: RequestRecord):
    return (r.last_token_time or r.end_time) - r.issue_time


def tpot(r: RequestRecord):
    if not r.output_tokens or r.output_tokens < 2 or r.first_token_time is None:
        return None
    return ((r.last_token_time or r.end_time) - r.first_token_time) / (r.output_tokens - 1)


def repeated_ngram_ratio(text: str, n: int = 4) -> float | None:
    words = text.split()
    grams = [tuple(words[i:i + n]) for i in range(len(words) - n + 1)]
    if not grams:
        return None
    return 1.0 - len(set(grams)) / len(grams)


def meets_slo(r: RequestRecord, slo: dict) -> bool:
    checks = {"ttft_s": ttft(r), "tpot_s": tpot(r), "e2e_s": e2e(r)}
    return all(checks[k] is None or checks[k] <= v for k, v in slo.items())


@dataclass
class _Profiled:
    """The records and sessions a summary counts: those of the profiling phase."""
    requests: list[RequestRecord]
    ok: list[RequestRecord]
    failed: list[RequestRecord]
    sessions: list[SessionRecord]
    tasks: list[SessionRecord]      # sessions completed untruncated inside the window
    window_s: float

    @classmethod
    def select(cls, records: list[RequestRecord], sessions: list[SessionRecord],
               window_start: float, window_end: float, active_s: float | None = None) -> "_Profiled":
        prof = [r for r in records if r.phase == PHASE_PROFILING]
        s_prof = [s for s in sessions if s.phase == PHASE_PROFILING]
        tasks = [s for s in s_prof if s.completed and not s.truncated
                 and s.start_time is not None and s.start_time >= window_start
                 and s.end_time <= window_end]
        return cls(requests=prof, ok=[r for r in prof if r.ok], failed=[r for r in prof if not r.ok],
                   sessions=s_prof, tasks=tasks,
                   window_s=max(0.0, window_end - window_start) if active_s is None else active_s)


def _counts(records: list[RequestRecord], p: _Profiled) -> dict:
    incomplete = [r for r in p.ok if r.ignore_eos and r.output_tokens is not None
                  and r.requested_output_tokens and r.output_tokens < r.requested_output_tokens]
    sent = len(p.requests)
    by_class = Counter(r.error_class for r in p.failed)
    overflow = by_class.get("context_overflow", 0)
    return {
        "requests": {"sent": sent, "completed": len(p.ok), "failed": len(p.failed),
                     "warmup": len(records) - sent, "incomplete_outputs": len(incomplete),
                     "usage_missing": sum(1 for r in p.ok if not r.usage_reported)},
        "errors": {"total": len(p.failed), "rate": len(p.failed) / sent if sent else 0.0,
                   "by_class": dict(sorted(by_class.items())),
                   "context_overflow_rate": overflow / sent if sent else 0.0},
        "sessions": {"started": len(p.sessions), "completed": len(p.tasks),
                     "truncated": sum(1 for s in p.sessions if s.truncated),
                     "incomplete": sum(1 for s in p.sessions if not s.truncated and not s.completed),
                     "ended_by": dict(Counter(s.ended_by for s in p.sessions if s.ended_by))},
    }


def _task_rates(p: _Profiled, concurrency: int | None) -> dict:
    out = {"tasks_per_hour": len(p.tasks) / p.window_s * 3600.0 if p.window_s > 0 else 0.0}
    lat = [s.latency_s for s in p.tasks]
    if concurrency and lat:
        out["tasks_per_hour_littles_law"] = concurrency / float(np.mean(lat)) * 3600.0
    return out


def _distributions(ok: list[RequestRecord], tasks: list[SessionRecord]) -> dict:
    tpots = [tpot(r) for r in ok]
    tpot_s = describe(tpots, "s")
    return {
        "ttft_s": describe([ttft(r) for r in ok], "s"),
        "ttft_queue_s": describe([ttft_queue(r) for r in ok], "s"),
        "e2e_s": describe([e2e(r) for r in ok], "s"),
        "e2e_queue_s": describe([e2e_queue(r) for r in ok], "s"),
        "tpot_s": tpot_s,
        "itl_s": describe([g for r in ok for g in r.chunk_gaps_s], "s"),
        "interactivity_tok_s": describe([1.0 / t for t in tpots if t], "tok/s/user"),
        # InferenceX convention: pX interactivity = 1 / (pX of TPOT), the slow tail.
        "interactivity_from_tpot": {
            k: (1.0 / v if v else None) for k, v in tpot_s.items() if k.startswith("p")},
        "e2e_norm_interactivity_tok_s": describe(
            [r.output_tokens / e2e(r) for r in ok if r.output_tokens and e2e(r) > 0], "tok/s/user"),
        "input_tokens": describe([r.input_tokens for r in ok], "tokens"),
        "output_tokens": describe([r.output_tokens for r in ok], "tokens"),
        "task_latency_s": describe([s.latency_s for s in tasks], "s"),
        "task_model_time_s": describe([s.model_time_s for s in tasks], "s"),
        "task_think_time_s": describe([s.think_time_s for s in tasks], "s"),
        "task_requests": describe([s.num_requests for s in tasks], "requests"),
    }


def _throughput(ok: list[RequestRecord]) -> dict:
    dur = max(max(r.end_time for r in ok) - min(r.send_time for r in ok), 1e-9) if ok else 0.0
    n_in = sum(r.input_tokens or 0 for r in ok)
    n_out = sum(r.output_tokens or 0 for r in ok)
    return {"duration_s": dur, "input_tokens": n_in, "output_tokens": n_out,
            "input_tok_s": n_in / dur if dur else 0.0, "output_tok_s": n_out / dur if dur else 0.0,
            "total_tok_s": (n_in + n_out) / dur if dur else 0.0,
            "requests_per_s": len(ok) / dur if dur else 0.0}


def _concurrency(requests: list[RequestRecord], window_start: float, window_end: float,
                 active_s: float | None = None) -> dict:
    intervals = [(r.send_time, r.end_time) for r in requests if r.send_time is not None and r.end_time]
    effective = (step_time_average(intervals, window_start, window_end) if active_s is None else
                 sum(e - s for s, e in intervals) / active_s if active_s > 0 else 0.0)
    times, counts = in_flight_series(intervals)
    active = 0.0
    if len(times) > 1:
        dt = np.diff(times)
        active = float(dt[counts[:-1] > 0].sum())
    return {"effective": effective,
            "active": (sum(e - s for s, e in intervals) / active) if active > 0 else 0.0,
            "max_in_flight": int(counts.max()) if counts.size else 0}


def _goodput(p: _Profiled, slo: dict) -> dict:
    out: dict = {"slo": dict(slo)}
    if slo:
        good = [r for r in p.ok if meets_slo(r, slo)]
        w = p.window_s
        out.update({"requests": len(good), "requests_per_s": len(good) / w if w else 0.0,
                    "fraction": len(good) / len(p.requests) if p.requests else 0.0,
                    "output_tok_s": sum(r.output_tokens or 0 for r in good) / w if w else 0.0})
    return out


def _cache(records: list[RequestRecord], requests: list[RequestRecord], page_size: int) -> dict:
    tot_blocks = sum(r.total_blocks for r in requests)
    return {
        # AgentX's definition: trace blocks (hash ids) seen before in the same namespace.
        "theoretical_hit_rate": (sum(r.theoretical_hit_blocks for r in requests) / tot_blocks
                                 if tot_blocks else None),
        # Server tokens: reported cached vs reusable by a perfect page-granular cache.
        **prefix_cache_rates(records, page_size)}


def _qps(ok: list[RequestRecord], window_start: float, window_s: float) -> dict:
    if not ok:
        return describe([], "requests/s")
    bins = np.floor((np.array([r.end_time for r in ok]) - window_start)).astype(int)
    nbins = max(1, int(np.ceil(window_s)))
    qps = np.bincount(np.clip(bins, 0, nbins - 1), minlength=nbins)
    return describe(qps.tolist(), "requests/s")


def _degeneration(ok: list[RequestRecord]) -> dict:
    return {
        "repeated_4gram_ratio": describe([repeated_ngram_ratio(r.output_text or "") for r in ok]),
        "hit_max_tokens_rate": (sum(1 for r in ok if r.finish_reason == "length" or (
            r.output_tokens or 0) >= (r.requested_output_tokens or 1 << 30)) / len(ok)) if ok else None}


def _confidence_intervals(p: _Profiled, n_boot: int, seed: int) -> dict:
    by_session: dict[str, list[RequestRecord]] = {}
    for r in p.ok:
        by_session.setdefault(r.tree_id, []).append(r)
    groups = list(by_session.values())
    lat = [s.latency_s for s in p.tasks]
    ci = {}
    if len(lat) >= 2:
        ci["task_latency_mean"] = bootstrap_ci([[x] for x in lat], "mean", n_boot, seed=seed)
        ci["task_latency_p90"] = bootstrap_ci([[x] for x in lat], "p90", n_boot, seed=seed)
    if len(groups) >= 2:
        ci["ttft_mean"] = bootstrap_ci([[ttft(r) for r in g] for g in groups], "mean", n_boot, seed=seed)
        ci["tpot_mean"] = bootstrap_ci([[t for r in g if (t := tpot(r)) is not None] for g in groups],
                                       "mean", n_boot, seed=seed)
    return ci


def _validity(errors: dict, sent: int, params: SummaryParams) -> dict:
    reasons = []
    if params.cancelled:
        reasons.append("run cancelled")
    if params.abort_reason:
        reasons.append(f"run aborted: {params.abort_reason}")
    if errors["rate"] > params.max_error_rate:
        reasons.append(f"error rate {errors['rate']:.3f} > {params.max_error_rate}")
    if errors["context_overflow_rate"] > params.max_overflow_rate:
        reasons.append(f"context-overflow rate {errors['context_overflow_rate']:.3f} "
                       f"> {params.max_overflow_rate}")
    if not sent:
        reasons.append("no profiled requests")
    return {"valid": not reasons, "reasons": reasons}


def compute_summary(records: list[RequestRecord], sessions: list[SessionRecord],
                    window_start: float, window_end: float, params: SummaryParams) -> dict:
    p = _Profiled.select(records, sessions, window_start, window_end, params.active_s)
    out: dict = {"schema_version": SCHEMA_VERSION, "window_start": window_start,
                 "window_end": window_end, "window_s": p.window_s, "mode": params.mode,
                 "load_point": {"concurrency": params.concurrency, "request_rate": params.request_rate}}
    out.update(_counts(records, p))
    out.update(_task_rates(p, params.concurrency))
    out.update(_distributions(p.ok, p.tasks))
    out["throughput"] = _throughput(p.ok)
    out["concurrency"] = _concurrency(p.requests, window_start, window_end, params.active_s)
    out["goodput"] = _goodput(p, params.slo)
    out["cache"] = _cache(records, p.requests, params.page_size)
    out["qps"] = _qps(p.ok, window_start, p.window_s)
    if params.mode == "live":
        out["degeneration"] = _degeneration(p.ok)
    out["confidence_intervals"] = _confidence_intervals(p, params.n_boot, params.seed)
    out["validity"] = _validity(out["errors"], len(p.requests), params)
    return out
