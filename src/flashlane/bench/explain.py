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
            def change(g):
                return f"rises {fmt(g)}×" if g >= 1 else f"falls to {fmt(g)}× of it"
            lines.append(f"From load {load} to {last[0]}, tasks/hour {change(ga)} on {name_a} and "
                         f"{change(gb)} on {name_b}: more sessions in flight "
                         f"{'pay off more for ' + name_a if ga > gb else 'pay off more for ' + name_b}.")
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
    """'2.05× (95% CI 1.80–2.40×, 4 paired tasks)' for a PointFinding."""
    if f.ratio is None:
        return "– (no measured task)"
    if f.ci is None:
        return (f"{f.ratio:.2f}× (too few tasks for a CI: {len(f.hybrid_latencies)} vs "
                f"{len(f.standard_latencies)})")
    if f.ci["low"] is None:
        return f"{f.ratio:.2f}× (95% CI unbounded, {f.ci.get('n_pairs', f.ci['n_a'])} pairs)"
    what = (f"{f.ci['n_pairs']} paired rounds" if "n_pairs" in f.ci and f.ci["n_pairs"] != len(f.hybrid_latencies)
            else f"{f.ci['n_pairs']} paired tasks" if "n_pairs" in f.ci else f"{f.ci['n_a']} vs {f.ci['n_b']} tasks")
    return f"{f.ratio:.2f}× (95% CI {f.ci['low']:.2f}–{f.ci['high']:.2f}×, {what})"


def _verdict_sentence(f, hybrid: str, standard: str, load_name: str) -> str:
    from .findings import FASTER, SAME, SLOWER, disagreement
    where = f"under {f.stack} at {load_name} {f.load:g}"
    if f.verdict == SLOWER:
        text = f"{where}, {hybrid} is slower per task than {standard}: {ratio_words(f)}"
    elif f.verdict == FASTER:
        text = f"{where}, {hybrid} is faster per task than {standard}: {ratio_words(f)}"
    elif f.verdict == SAME:
        text = f"{where}, no significant difference per task ({hybrid}/{standard} {ratio_words(f)}; the CI spans 1)"
    else:
        text = f"{where}, {hybrid}/{standard} per task {ratio_words(f)}: not enough tasks to tell"
    other = disagreement(f)
    if other:
        text += f"; the wall-clock verdict is not the engine's: {other}, so trust neither blindly"
    if f.noisy:
        text += f" — noisy rounds: {'; '.join(f.noisy)}"
    return text[0].upper() + text[1:] + "."


def _ci_words(f) -> str:
    if f.ci is None or f.ci["low"] is None:
        return f"{f.ratio:.2f}×" if f.ratio is not None else "–"
    return f"{f.ratio:.2f}× (95% CI {f.ci['low']:.2f}–{f.ci['high']:.2f}×)"


def headline(findings: list, hybrid: str, standard: str, load_name: str = "concurrency",
             mechanisms: dict[str, str] | None = None, unequal: list[str] | None = None) -> str:
    """The answer in one line, for one stated load point: the stack that reproduces the public
    finding's direction (the hybrid slower per task) and the stack, with its mechanism, that
    closes it, both ratios with CIs; whether the engine's own time agrees; unequal conditions
    and noisy rounds said so."""
    from .findings import disagreement
    text, point = _headline(findings, hybrid, standard, load_name, mechanisms or {})
    if point:
        other = [f"{f.stack}: {d}" for f in findings if f.load == point and (d := disagreement(f))]
        have_engine = any(f.engine for f in findings if f.load == point)
        if other:
            text += " The engine's own time disagrees (" + "; ".join(other) + "), so trust neither verdict blindly."
        elif have_engine:
            text += " The engine's busy time and the servers' CPU time per task give the same verdicts."
    if unequal:
        text += f" Unequal serving conditions ({', '.join(unequal)}): the ratios mix serving speed with them."
    noisy = sum(1 for f in findings if f.noisy)
    if noisy:
        text += (f" Noisy: co-tenants were busy during {noisy} of {len(findings)} comparisons; rounds were "
                 f"interleaved and paired, so the ratios hold up better than the times themselves.")
    return text


def _headline(findings: list, hybrid: str, standard: str, load_name: str,
              mechanisms: dict[str, str]) -> tuple[str, float | None]:
    from .findings import FASTER, SAME, reproducing_stacks
    if not findings:
        return "No load point finished, so there is no answer.", None
    repro = reproducing_stacks(findings)
    first = min(f.load for f in findings)
    if not repro:
        return (f"No stack reproduces the public finding's direction with significance ({hybrid} "
                f"slower per task than {standard}); at {load_name} {first:g}: " + "; ".join(
                    f"{f.stack} {f.verdict} ({_ci_words(f)})" for f in findings if f.load == first) + ".", first)
    point = min(f.load for f in repro)
    best = max((f for f in repro if f.load == point), key=lambda f: f.ratio)
    text = (f"At {load_name} {point:g}, {best.stack} reproduces the public finding: {hybrid} is "
            f"{_ci_words(best)} slower per task than {standard}")
    if mechanisms.get(best.stack):
        text += f" ({mechanisms[best.stack]})"
    closing = [f for f in findings if f.load == point and f.verdict in (FASTER, SAME)]
    if closing:
        # the stack that closes the gap by making the hybrid fast, not one that slows the
        # standard model down to it (no cache for either): the fastest hybrid per task
        close = min(closing, key=lambda f: (f.mean("hybrid") is None, f.mean("hybrid") or 0.0))
        how = "the hybrid faster" if close.verdict == FASTER else "no significant difference"
        text += (f"; {close.stack} closes it with {mechanisms.get(close.stack) or 'its flags'}: "
                 f"{_ci_words(close)}, {how}")
    else:
        text += f"; no stack run closes it at {load_name} {point:g}"
    return text + ".", point


def explain_stacks(findings: list, hybrid: str, standard: str, load_name: str = "concurrency",
                   steps: list[dict] | None = None, attribution: list[str] | None = None,
                   mechanisms: dict[str, str] | None = None, unequal: list[str] | None = None) -> list[str]:
    """Headline, each point's verdict, flips between load points, the measured attribution lines,
    then what each stack change did (waterfall steps)."""
    from .findings import flips
    lines = [headline(findings, hybrid, standard, load_name, mechanisms, unequal)]
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
        lines.append(f"From {prev['stack']} to {s['stack']} at {load_name} {s['load']:g}: "
                     f"{hybrid} {fmt(prev['hybrid_s'])} → "
                     f"{fmt(s['hybrid_s'])} s per task, {standard} {fmt(prev['standard_s'])} → "
                     f"{fmt(s['standard_s'])} s; the ratio moves {prev['ratio']:.2f}× → {s['ratio']:.2f}×.")
    return lines


def partition_sentence(model: str, stack: str, label: str, p: dict) -> str:
    """One measured attribution line: a task's time by component, and how well the parts add up."""
    from .attribution import COMPONENTS
    parts = ", ".join(f"{fmt(p[k])} s {name}" for k, name in COMPONENTS)
    diff = (p["sum_s"] - p["task_s"]) / p["task_s"] * 100 if p["task_s"] else 0.0
    return (f"{model} under {stack} at {label}: a task's {fmt(p['task_s'])} s (mean of {p['tasks']}, measured) "
            f"is {parts} (the parts sum to {fmt(p['sum_s'])} s, {diff:+.1f}%).")
