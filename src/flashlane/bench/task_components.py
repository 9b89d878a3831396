"""Per-task views of one run's records: the measured tasks, the replayed token counts of each
(what `analyze` predicts from) and the measured time split into prefill, decode and the rest."""

from __future__ import annotations

from .metrics import e2e, ttft
from .records import PHASE_PROFILING, RequestRecord, SessionRecord


def measured_sessions(sessions: list[SessionRecord]) -> list[SessionRecord]:
    """Whole tasks inside the profiling window (t*-truncated and unfinished ones left out)."""
    return [s for s in sessions if s.phase == PHASE_PROFILING and s.completed and not s.truncated
            and s.latency_s is not None]


def task_latencies(sessions: list[SessionRecord]) -> list[float]:
    return [s.latency_s for s in measured_sessions(sessions)]


def _requests_by_task(records: list[RequestRecord], sessions: list[SessionRecord]) -> dict[str, list]:
    keep = {s.tree_id for s in measured_sessions(sessions)}
    out: dict[str, list] = {t: [] for t in keep}
    for r in sorted(records, key=lambda r: r.send_time or 0.0):
        if r.tree_id in keep and r.phase == PHASE_PROFILING and r.ok:
            out[r.tree_id].append(r)
    return out


def replayed_turns(records: list[RequestRecord], sessions: list[SessionRecord]) -> list[list[tuple[int, int, int]]]:
    """Per measured task, its requests in send order as (prompt tokens, cached prompt tokens as
    the server reported them, output tokens); sub-agent requests included."""
    return [[(r.input_tokens or r.requested_input_tokens or 0, r.cached_tokens or 0,
              r.output_tokens or r.requested_output_tokens or 0) for r in reqs]
            for reqs in _requests_by_task(records, sessions).values() if reqs]


def measured_components(records: list[RequestRecord], sessions: list[SessionRecord]) -> dict | None:
    """Mean per task: prefill (sum of TTFTs), decode (sum of E2E - TTFT), task latency, and the
    think/tool time the replay scheduled; None without a measured task."""
    by_task = _requests_by_task(records, sessions)
    done = {s.tree_id: s for s in measured_sessions(sessions)}
    if not by_task:
        return None
    pre = [sum(ttft(r) or 0.0 for r in reqs) for reqs in by_task.values()]
    dec = [sum(max(0.0, e2e(r) - (ttft(r) or 0.0)) for r in reqs) for reqs in by_task.values()]
    n = len(by_task)
    return {"tasks": n, "prefill_s": sum(pre) / n, "decode_s": sum(dec) / n,
            "task_s": sum(done[t].latency_s for t in by_task) / n,
            "think_s": sum(done[t].think_time_s for t in by_task) / n}
