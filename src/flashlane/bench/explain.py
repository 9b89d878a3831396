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


# ---- multi-stack findings (compare --stacks) -------------------------------------------------

def ratio_words(f) -> str:
    """'2.05× (95% CI 1.80–2.40×, 4 vs 4 tasks)' for a PointFinding."""
    if f.ratio is None:
        return "– (no measured task)"
    if f.ci is None:
        return (f"{f.ratio:.2f}× (too few tasks for a CI: {len(f.hybrid_latencies)} vs "
                f"{len(f.standard_latencies)})")
    return (f"{f.ratio:.2f}× (95% CI {f.ci['low']:.2f}–{f.ci['high']:.2f}×, {f.ci['n_a']} vs "
            f"{f.ci['n_b']} tasks)")


def _verdict_sentence(f, hybrid: str, standard: str, load_name: str) -> str:
    from .findings import FASTER, SAME, SLOWER
    where = f"under {f.stack} at {load_name} {f.load:g}"
    if f.verdict == SLOWER:
        text = f"{where}, {hybrid} is slower per task than {standard}: {ratio_words(f)}"
    elif f.verdict == FASTER:
        text = f"{where}, {hybrid} is faster per task than {standard}: {ratio_words(f)}"
    elif f.verdict == SAME:
        text = f"{where}, no significant difference per task ({hybrid}/{standard} {ratio_words(f)}; the CI spans 1)"
    else:
        text = f"{where}, {hybrid}/{standard} per task {ratio_words(f)}: not enough tasks to tell"
    if f.noisy:
        text += f" — noisy run: {'; '.join(f.noisy)}"
    return text[0].upper() + text[1:] + "."


def headline(findings: list, hybrid: str, standard: str, load_name: str = "concurrency") -> str:
    """The answer in one line: which stack reproduces the public finding's direction (the hybrid
    slower per task), by how much, with CI; and which stack closes it; noisy runs said so."""
    noisy = sum(1 for f in findings if f.noisy)
    note = (f" Noisy: the machine was busy during {noisy} of {len(findings)} comparisons, so "
            f"timings are distorted; rerun on an idle machine." if noisy else "")
    return _headline(findings, hybrid, standard, load_name) + note


def _headline(findings: list, hybrid: str, standard: str, load_name: str) -> str:
    from .findings import FASTER, SAME, reproducing_stacks
    if not findings:
        return "No load point finished, so there is no answer."
    repro = reproducing_stacks(findings)
    first = min(f.load for f in findings)
    if repro:
        best = max(repro, key=lambda f: f.ratio)
        text = (f"{best.stack} reproduces the public finding's direction: {hybrid} is {best.ratio:.2f}× "
                f"slower per task than {standard} (95% CI {best.ci['low']:.2f}–{best.ci['high']:.2f}×) "
                f"at {load_name} {best.load:g}")
        others = sorted({f.stack for f in repro} - {best.stack})
        if others:
            text += f" (also under {', '.join(others)})"
    else:
        text = (f"No stack reproduces the public finding's direction with significance ({hybrid} "
                f"slower per task than {standard}); at {load_name} {first:g}: " + "; ".join(
                    f"{f.stack} {f.verdict} ({f.ratio:.2f}×)" if f.ratio is not None else f"{f.stack} {f.verdict}"
                    for f in findings if f.load == first))
        return text + "."
    closing = [f for f in findings if f.load == first and f.verdict in (FASTER, SAME)
               and f.stack not in {r.stack for r in repro}]
    if closing:
        text += "; closed under " + ", ".join(
            f"{f.stack} ({'faster, ' if f.verdict == FASTER else 'no significant difference, '}"
            f"{f.ratio:.2f}×)" for f in closing)
    return text + "."


def explain_stacks(findings: list, hybrid: str, standard: str, load_name: str = "concurrency",
                   steps: list[dict] | None = None, attribution: list[str] | None = None) -> list[str]:
    """Headline, each point's verdict, flips between load points, what each stack change did
    (waterfall steps), then the attribution lines (predicted vs measured, profile)."""
    from .findings import flips
    lines = [headline(findings, hybrid, standard, load_name)]
    lines += [_verdict_sentence(f, hybrid, standard, load_name)
              for f in findings]  # in run order: stack by stack, load points ascending
    for stack in dict.fromkeys(f.stack for f in findings):
        for a, b in flips([f for f in findings if f.stack == stack]):
            sig = ("both significant" if a.ci and b.ci and a.ci["significant"] and b.ci["significant"]
                   else "at least one side not significant")
            lines.append(f"The verdict flips under {stack} between {load_name} {a.load:g} "
                         f"({a.ratio:.2f}×) and {b.load:g} ({b.ratio:.2f}×); {sig}.")
    lines += list(attribution or [])
    for prev, s in zip(steps or [], (steps or [])[1:]):
        if s["d_ratio"] is None:
            continue
        lines.append(f"From {prev['stack']} to {s['stack']}: {hybrid} {fmt(prev['hybrid_s'])} → "
                     f"{fmt(s['hybrid_s'])} s per task, {standard} {fmt(prev['standard_s'])} → "
                     f"{fmt(s['standard_s'])} s; the ratio moves {prev['ratio']:.2f}× → {s['ratio']:.2f}×.")
    return lines


def prediction_sentence(model: str, stack: str, predicted: dict, measured: dict) -> str:
    """Prediction beside measurement per component; the residual is serving overhead."""
    model_time = measured["prefill_s"] + measured["decode_s"]
    residual = measured["task_s"] - measured["think_s"] - predicted["task_s"]
    return (f"{model} under {stack}: analyze predicts {fmt(predicted['prefill_s'])} s prefill + "
            f"{fmt(predicted['decode_s'])} s decode = {fmt(predicted['task_s'])} s of model time per "
            f"task on this machine; measured {fmt(measured['prefill_s'])} s + {fmt(measured['decode_s'])} s "
            f"(= {fmt(model_time)} s) and {fmt(measured['task_s'] - measured['think_s'])} s per task "
            f"outside think/tool time; the residual {fmt(residual)} s is serving overhead (dispatch, "
            f"scheduling, idle).")
