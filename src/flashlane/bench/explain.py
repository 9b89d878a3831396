"""Plain-language explanation of an A/B comparison, derived only from the two sets of summaries."""

from __future__ import annotations

from .report_rows import fmt


def _ratio(a, b):
    return a / b if a is not None and b not in (None, 0) else None


def _per_task_split(s: dict) -> tuple[float, float, float] | None:
    """(prefill, decode, think) seconds per task, from request means and requests per task."""
    n = s["task_requests"]["mean"]
    if not n or s["ttft_s"]["mean"] is None:
        return None
    prefill = n * s["ttft_s"]["mean"]
    decode = n * max(0.0, s["e2e_s"]["mean"] - s["ttft_s"]["mean"])
    return prefill, decode, s["task_think_time_s"]["mean"] or 0.0


def explain(name_a: str, name_b: str, points: list[tuple[int | float, dict, dict]], mode: str) -> list[str]:
    """Sentences about where the A-vs-B difference comes from; points = [(load, summary A, summary B)]."""
    if not points:
        return ["No load point finished, so there is nothing to compare."]
    lines = []
    first = points[0]
    oa, ob = first[1]["output_tokens"]["mean"], first[2]["output_tokens"]["mean"]
    ia, ib = first[1]["input_tokens"]["mean"], first[2]["input_tokens"]["mean"]
    if mode == "recorded":
        lines.append(
            f"Both servers replayed the identical recorded agentic workload (same seed, same prompts, "
            f"output lengths forced with ignore_eos: {fmt(oa)} vs {fmt(ob)} output and {fmt(ia)} vs "
            f"{fmt(ib)} prompt tokens per request as the servers counted them), so every difference "
            f"below is serving speed, not model behaviour (more or longer turns).")
    else:
        lines.append(f"Live mode: each server's own output was fed back, so turn lengths differ "
                     f"({fmt(oa)} vs {fmt(ob)} output tokens per request) and model behaviour is mixed "
                     f"with serving speed.")
    load, sa, sb = first
    la, lb = sa["task_latency_s"]["mean"], sb["task_latency_s"]["mean"]
    r = _ratio(la, lb)
    if r is not None:
        lines.append(f"At load {load}, a task takes {fmt(la)} s on {name_a} and {fmt(lb)} s on {name_b} "
                     f"({fmt(r)}×); tasks/hour {fmt(sa['tasks_per_hour'])} vs {fmt(sb['tasks_per_hour'])}.")
        pa, pb = _per_task_split(sa), _per_task_split(sb)
        if pa and pb:
            d_pre, d_dec, d_think = pa[0] - pb[0], pa[1] - pb[1], pa[2] - pb[2]
            total = abs(d_pre) + abs(d_dec) + abs(d_think) or 1.0
            lines.append(
                f"Per task, prefill (time to first token) costs {fmt(pa[0])} s vs {fmt(pb[0])} s, decode "
                f"{fmt(pa[1])} s vs {fmt(pb[1])} s, and think/tool time {fmt(pa[2])} s vs {fmt(pb[2])} s "
                f"(scheduled identically on both; the rest of it is client overhead and timer slack). Of the gap, {fmt(100 * abs(d_pre) / total)}% comes from "
                f"prefill, {fmt(100 * abs(d_dec) / total)}% from decode and "
                f"{fmt(100 * abs(d_think) / total)}% from waiting.")
        tpa, tpb = sa["tpot_s"]["mean"], sb["tpot_s"]["mean"]
        if tpa and tpb:
            faster = name_a if tpa < tpb else name_b
            lines.append(f"Decode speed: {fmt(1 / tpa)} vs {fmt(1 / tpb)} tokens/s per request "
                         f"({faster} is faster per token, {fmt(max(tpa, tpb) / min(tpa, tpb))}×).")
    if len(points) > 1:
        last = points[-1]
        ga = _ratio(last[1]["tasks_per_hour"], sa["tasks_per_hour"])
        gb = _ratio(last[2]["tasks_per_hour"], sb["tasks_per_hour"])
        if ga and gb:
            lines.append(f"From load {load} to {last[0]}, tasks/hour grows {fmt(ga)}× on {name_a} and "
                         f"{fmt(gb)}× on {name_b}: batching more sessions "
                         f"{'helps ' + name_a + ' more' if ga > gb else 'helps ' + name_b + ' more'}.")
    ta, tb = sa.get("telemetry") or {}, sb.get("telemetry") or {}
    if ta.get("busy_overall") is not None and tb.get("busy_overall") is not None:
        def gap_words(t):
            g = t.get("idle_gaps") or {}
            by = g.get("by_class") or {}
            top = max(by, key=lambda c: by[c]["total_s"]) if by and g.get("count") else None
            return (f"{g.get('count', 0)} idle gaps, mostly class {top} ({by[top]['name']})" if top
                    else "no idle gaps")
        lines.append(f"Utilisation at load {load}: {fmt(ta['busy_overall'])} vs {fmt(tb['busy_overall'])} "
                     f"busy ({name_a}: {gap_words(ta)}; {name_b}: {gap_words(tb)}). Class A gaps are "
                     f"think/tool time with nothing in flight, inherent at low concurrency; class B gaps "
                     f"(requests in flight, device idle) point at the serving stack.")
    ca = (sa.get("server_info") or {}).get("cache_bytes_per_token")
    cb = (sb.get("server_info") or {}).get("cache_bytes_per_token")
    if ca and cb:
        lines.append(f"Cache per token: {fmt(ca)} vs {fmt(cb)} bytes ({fmt(ca / cb)}×), which sets how "
                     f"many concurrent sessions fit in memory at long contexts.")
    return lines
