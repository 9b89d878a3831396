"""The comparison's findings and report: paired findings per (stack, load point), the answer
line, and compare.md / compare.json / report.html with the per-stack table, the measured
attribution of a task's time, the simulated figures beside the measured ones with their errors,
the counterfactual waterfall, the interleaved schedule and the serving conditions of each side."""

from __future__ import annotations

import json
import os
from pathlib import Path

from . import plots, report_html, report_md
from .attribution import COMPONENTS
from .compare_runs import PointRun, StackRun, load_of, ratio
from .conditions import differing, mismatches, server_conditions
from .explain import explain, explain_stacks, partition_sentence, ratio_words
from .findings import PointFinding, disagreement, paired_finding, waterfall
from .records import read_requests, read_sessions
from .report_rows import fmt, ms
from .runner import BenchConfig, build_source, cdf_series, sweep_points
from .stats import keyed_ratio

LOAD_AXIS = "concurrency (sessions in flight)"


def _gaps(s: dict) -> str:
    g = (s.get("telemetry") or {}).get("idle_gaps")
    if not g:
        return "–"
    return f"{g['count']} / {fmt(g['total_s'])} s (" + ", ".join(
        f"{c} {fmt(v['total_s'])}s" for c, v in g["by_class"].items()) + ")"


def compare_rows(sa: dict, sb: dict) -> list[tuple[str, str, str, str]]:
    """(metric, A, B, A/B) in the seed study's terms."""
    def line(label, va, vb, show=fmt):
        r = ratio(va, vb)
        return (label, show(va), show(vb), f"{r:.2f}×" if r is not None else "–")

    ta, tb = sa.get("telemetry") or {}, sb.get("telemetry") or {}
    rows = [
        line("task latency mean (s)", sa["task_latency_s"]["mean"], sb["task_latency_s"]["mean"]),
        line("task latency p90 (s)", sa["task_latency_s"]["p90"], sb["task_latency_s"]["p90"]),
        line("tasks / hour", sa["tasks_per_hour"], sb["tasks_per_hour"]),
        line("TTFT mean", sa["ttft_s"]["mean"], sb["ttft_s"]["mean"], ms),
        line("TTFT p90", sa["ttft_s"]["p90"], sb["ttft_s"]["p90"], ms),
        line("ITL mean (pooled)", sa["itl_s"]["mean"], sb["itl_s"]["mean"], ms),
        line("TPOT mean", sa["tpot_s"]["mean"], sb["tpot_s"]["mean"], ms),
        line("output tokens / s", sa["throughput"]["output_tok_s"], sb["throughput"]["output_tok_s"]),
        line("total tokens / s", sa["throughput"]["total_tok_s"], sb["throughput"]["total_tok_s"]),
    ]
    for key, label in (("prefix_cache_hit_rate", "prefix-cache hit (server)"),
                       ("prefix_cache_hit_rate_theoretical", "prefix-cache hit (theoretical)")):
        rows.append(line(label, sa["cache"].get(key), sb["cache"].get(key)))
    for key, label in (("cache_bytes_per_token", "cache bytes / token"),
                       ("state_bytes_per_sequence", "state bytes / sequence")):
        va, vb = (sa.get("server_info") or {}).get(key), (sb.get("server_info") or {}).get(key)
        if va is not None or vb is not None:
            rows.append(line(label, va, vb))
    if ta.get("busy_overall") is not None or tb.get("busy_overall") is not None:
        rows.append(line("utilisation (busy fraction)", ta.get("busy_overall"), tb.get("busy_overall")))
        rows.append(("idle gaps: count / time (by class)", _gaps(sa), _gaps(sb), "–"))
    rows.append(("errors", str(sa["errors"]["total"]), str(sb["errors"]["total"]), "–"))
    rows.append(("valid", "yes" if sa["validity"]["valid"] else "no",
                 "yes" if sb["validity"]["valid"] else "no", "–"))
    return rows


# ---- findings ------------------------------------------------------------------------------

def _per_task(rr, value: float | None) -> float | None:
    return value / rr.tasks if value is not None and rr.tasks else None


def round_pairs(ph: PointRun, ps: PointRun, hyb: str, std: str) -> dict[str, list[tuple[float, float]]]:
    """Per round with measured tasks on both sides: (hybrid, standard) mean task latency, engine
    busy seconds per task and engine CPU seconds per task (each kept only where both sides have it)."""
    out = {"wall": [], "engine": [], "cpu": []}
    for rh, rs in zip(ph.rounds, ps.rounds):
        if not rh.tasks or not rs.tasks:
            continue
        out["wall"].append((sum(rh.latencies) / rh.tasks, sum(rs.latencies) / rs.tasks))
        eh = _per_task(rh, (rh.engine or {}).get("busy_s"))
        es = _per_task(rs, (rs.engine or {}).get("busy_s"))
        if eh is not None and es is not None:
            out["engine"].append((eh, es))
        ch, cs = _per_task(rh, rh.cpu_s.get(hyb)), _per_task(rs, rs.cpu_s.get(std))
        if ch is not None and cs is not None:
            out["cpu"].append((ch, cs))
    return out


def findings_of(targets, groups: list[StackRun]) -> list[PointFinding]:
    hyb = next(t for t in targets if t.role == "hybrid")
    std = next(t for t in targets if t.role == "standard")
    out = []
    for g in groups:
        for ph, ps in zip(g.points[hyb.name], g.points[std.name]):
            noisy = [f"{t.name} {r}" for t, pr in ((hyb, ph), (std, ps)) for r in pr.machine.get("reasons", [])]
            pairs = round_pairs(ph, ps, hyb.name, std.name)
            out.append(paired_finding(g.name, load_of(ph.point), ph.latencies, ps.latencies, pairs["wall"],
                                      pairs["engine"], pairs["cpu"], noisy))
    return out


def _measure_words(m: dict | None) -> str:
    if not m or not m.get("ci"):
        return "–"
    c = m["ci"]
    if c["low"] is None:
        return f"{c['ratio']:.2f}× (CI unbounded)"
    return f"{c['ratio']:.2f}× ({c['low']:.2f}–{c['high']:.2f}×)"


def _cotenant(pa: PointRun, pb: PointRun) -> str:
    vals = [v for pr in (pa, pb) for v in pr.machine.get("rounds", []) if v is not None]
    if not vals:
        return "–"
    return f"{sum(vals) / len(vals):.0f}% (max {max(vals):.0f}%)"


def _pair(pa: PointRun, pb: PointRun, fn) -> str:
    return f"{fn(pa.summary)} / {fn(pb.summary)}"


def stack_table(targets, groups: list[StackRun], findings: list[PointFinding]) -> tuple[list[str], list[list[str]]]:
    """One row per (stack, load point), hybrid / standard in each cell."""
    hyb = next(t for t in targets if t.role == "hybrid")
    std = next(t for t in targets if t.role == "standard")
    head = ["stack", "load", f"{hyb.name} / {std.name} per-task latency (geometric mean of paired rounds, 95% CI)",
            "engine busy time per task", "server CPU time per task (HTTP + engine processes)", "tasks/h",
            "p90 task (s)", "TTFT mean", "ITL mean", "prefix-cache hit", "idle gaps by class", "co-tenant CPU (of 100% per core)", "noisy"]
    by_key = {(f.stack, f.load): f for f in findings}
    rows = []
    for g in groups:
        for ph, ps in zip(g.points[hyb.name], g.points[std.name]):
            f = by_key[(g.name, load_of(ph.point))]
            rows.append([g.name, f"{f.load:g}", ratio_words(f), _measure_words(f.engine), _measure_words(f.cpu),
                         _pair(ph, ps, lambda s: fmt(s["tasks_per_hour"])),
                         _pair(ph, ps, lambda s: fmt(s["task_latency_s"]["p90"])),
                         _pair(ph, ps, lambda s: ms(s["ttft_s"]["mean"])),
                         _pair(ph, ps, lambda s: ms(s["itl_s"]["mean"])),
                         _pair(ph, ps, lambda s: fmt(s["cache"].get("prefix_cache_hit_rate"))),
                         _pair(ph, ps, _gaps), _cotenant(ph, ps), "yes" if f.noisy else "no"])
    return head, rows


def attribution_table(groups: list[StackRun]) -> tuple[list[str], list[list[str]]]:
    """Measured per-task time by component (bench/attribution.py), per (stack, model, load)."""
    head = ["stack", "model", "load", "task (s)"] + [label + " (s)" for _, label in COMPONENTS] + [
        "parts sum (s)", "parts vs task", "co-tenant CPU"]
    rows = []
    for g in groups:
        for t, runs in g.points.items():
            for pr in runs:
                p = pr.partition
                if not p:
                    continue
                diff = (p["sum_s"] - p["task_s"]) / p["task_s"] if p["task_s"] else None
                cot = pr.machine.get("cotenant_cpu_percent")
                rows.append([g.name, t, pr.point.label, fmt(p["task_s"])] + [fmt(p[k]) for k, _ in COMPONENTS]
                            + [fmt(p["sum_s"]), f"{100 * diff:+.1f}%" if diff is not None else "–",
                               f"{cot:.0f}%" if cot is not None else "–"])
    return head, rows


def schedule_table(groups: list[StackRun]) -> tuple[list[str], list[list[str]]]:
    """Every round in the order run: when, how long, the load beside it, and what the idle
    server cost meanwhile."""
    head = ["stack", "load", "#", "round", "side", "tasks", "duration (s)", "co-tenant CPU",
            "this server's CPU (s)", "idle peer's CPU (s)"]
    rows = []
    for g in groups:
        for i in range(len(next(iter(g.points.values()), []))):
            rounds = sorted((rr for runs in g.points.values() for rr in runs[i].rounds), key=lambda r: r.position)
            for rr in rounds:
                peer = next((v for n, v in rr.cpu_s.items() if n != rr.side), None)
                cot = rr.machine.get("cotenant_cpu_percent")
                rows.append([g.name, rr.run_dir.parent.name, str(rr.position), str(rr.index), rr.side,
                             str(rr.tasks), fmt(rr.duration_s), f"{cot:.0f}%" if cot is not None else "–",
                             fmt(rr.cpu_s.get(rr.side)), fmt(peer)])
    return head, rows


def idle_peer_cost(groups: list[StackRun]) -> dict | None:
    """CPU seconds the idle server used while the other one ran, against the active one's."""
    idle = active = 0.0
    n = 0
    for g in groups:
        for runs in g.points.values():
            for pr in runs:
                for rr in pr.rounds:
                    peer = [v for k, v in rr.cpu_s.items() if k != rr.side and v is not None]
                    own = rr.cpu_s.get(rr.side)
                    if peer and own:
                        idle, active, n = idle + sum(peer), active + own, n + 1
    return {"rounds": n, "idle_cpu_s": idle, "active_cpu_s": active,
            "fraction": idle / active if active else None} if n else None


def _pct(x) -> str:
    return "–" if x is None else f"{100 * x:+.1f}%"


def simulation_table(groups: list[StackRun]) -> tuple[list[str], list[list[str]]]:
    """Per measured side: the measured figures beside the same rounds simulated, with the errors."""
    head = ["stack", "model", "load", "task mean: measured / simulated (s)", "error", "TTFT mean (ms)", "error",
            "ITL mean (ms)", "error", "prefix-cache hit", "per-step |error| median / p90",
            "machine time vs calibration: matmul / weight read / host", "task error as calibrated"]
    rows = []
    for g in groups:
        for t, runs in g.points.items():
            for pr in runs:
                sim = pr.simulated
                if not sim:
                    continue
                f, step = sim["figures"], (sim.get("per_step") or {}).get("all") or {}

                def pair(name, scale=1.0):
                    m, s_ = f[name]["measured"], f[name]["simulated"]
                    return f"{fmt(None if m is None else m * scale)} / {fmt(None if s_ is None else s_ * scale)}"
                hit = f["prefix_hit"]
                rows.append([g.name, t, pr.point.label, pair("task_s"), _pct(f["task_s"]["error"]),
                             pair("ttft_s", 1e3), _pct(f["ttft_s"]["error"]), pair("itl_s", 1e3),
                             _pct(f["itl_s"]["error"]),
                             f"{fmt(hit['measured'])} / {fmt(hit['simulated'])}",
                             f"{100 * step['median_rel_error']:.1f}% / {100 * step['p90_rel_error']:.1f}%"
                             if step else "–", _drift_cell(sim.get("drift")),
                             _pct(((sim.get("figures_as_calibrated") or {}).get("task_s") or {}).get("error"))])
    return head, rows


def _drift_cell(d: dict | None) -> str:
    return "not measured" if not d else f"{d['compute']:.2f} / {d['memory']:.2f} / {d['host']:.2f}×"


def simulated_ratios(findings: list[PointFinding], groups: list[StackRun], hyb: str, std: str) -> list[dict]:
    """Per stack and load point: the measured ratio with its CI beside the simulated one (the
    same tasks paired), and whether the simulated one lies inside the CI."""
    out = []
    for f in findings:
        g = next((g for g in groups if g.name == f.stack), None)
        if g is None:
            continue
        runs = {t: next((pr for pr in g.points.get(t, []) if load_of(pr.point) == f.load), None) for t in (hyb, std)}
        sims = [pr.simulated if pr else None for pr in runs.values()]
        if not all(sims):
            continue
        ratio = keyed_ratio(sims[0]["task_s_by_tree"], sims[1]["task_s_by_tree"])
        key = "task_s_by_tree_as_calibrated"
        as_cal = keyed_ratio(sims[0][key], sims[1][key]) if all(key in s for s in sims) else None
        lo, hi = (f.ci or {}).get("low"), (f.ci or {}).get("high")
        out.append({"stack": f.stack, "load": f.load, "measured": f.ratio, "ci": [lo, hi], "simulated": ratio,
                    "inside_ci": None if ratio is None or lo is None else lo <= ratio <= hi,
                    "simulated_as_calibrated": as_cal})
    return out


def ratio_table(ratios: list[dict]) -> tuple[list[str], list[list[str]]]:
    head = ["stack", "load", "hybrid / standard per task: measured (95% CI)", "simulated", "inside the CI",
            "simulated as calibrated"]
    return head, [[r["stack"], f"{r['load']:g}", f"{fmt(r['measured'])}× ({fmt(r['ci'][0])}–{fmt(r['ci'][1])}×)",
                   f"{fmt(r['simulated'])}×", {True: "yes", False: "no", None: "–"}[r["inside_ci"]],
                   "–" if r.get("simulated_as_calibrated") is None else f"{fmt(r['simulated_as_calibrated'])}×"]
                  for r in ratios]


def counterfactual_table(cf: dict | None) -> tuple[list[str], list[list[str]]]:
    head = ["change (cumulative)", "hybrid / standard (simulated)", "hybrid task (s)", "standard task (s)",
            "share of the gap"]
    if not cf:
        return head, []
    return head, [[s["change"], f"{fmt(s['ratio'])}×", fmt(s["hybrid_task_s"]), fmt(s["standard_task_s"]),
                   _pct(s.get("share_of_gap")).lstrip("+") if s.get("share_of_gap") is not None else "–"]
                  for s in cf["steps"]]


# ---- serving conditions --------------------------------------------------------------------

def stack_conditions(targets, groups: list[StackRun]) -> list[tuple[str, dict[str, dict]]]:
    """Per stack (in the order run), what each target's server reported running at its first
    measured point."""
    out = []
    for g in groups:
        conds = {}
        for t in targets:
            pr = next(iter(g.points.get(t.name, [])), None)
            conds[t.name] = server_conditions((pr.summary.get("_manifest") or {}).get("server_models") if pr else None)
        out.append((g.name, conds))
    return out


def later_stack_conditions(per_stack: list[tuple[str, dict[str, dict]]]) -> tuple[list[str], list[str]]:
    """(a line per later stack whose servers ran otherwise than the first stack's, e.g. static
    graphs running their own linears; the sides that ran unequal inside such a stack)."""
    lines, unequal = [], []
    if not per_stack:
        return lines, unequal
    first = per_stack[0][1]
    for stack, conds in per_stack[1:]:
        differs = [f"{name}: " + ", ".join(f"{k} {c[k]} (first stack: {first[name][k]})" for k in fields)
                   for name, c in conds.items() if (fields := differing(c, first.get(name, {})))]
        if differs:
            lines.append(f"the {stack} stack ran otherwise: " + "; ".join(differs))
        names = list(conds)
        if len(names) == 2:
            unequal += [f"{stack}: {m}" for m in mismatches(conds[names[0]], conds[names[1]])]
    return lines, unequal


def _threads(n) -> str:
    return "threads not reported" if not n else f"{n} thread" + ("" if n == 1 else "s")


def conditions_lines(conds: dict[str, dict], resolved: dict | None) -> tuple[list[str], list[str]]:
    """(one line per side for the header, the mismatches)."""
    lines = []
    for name, c in conds.items():
        q = c.get("quantization") or "none reported"
        lines.append(f"{name}: dtype {c.get('dtype') or 'not reported'}, "
                     f"{_threads(c.get('num_threads'))}, quantisation {q}, "
                     f"KV cache {c.get('kv_cache_dtype') or 'not reported'}, "
                     f"linears {c.get('linear_kernel') or 'not reported'}")
    if resolved:
        why = f" ({resolved['dtype_reason']})" if resolved.get("dtype_reason") else ""
        linears = f", linears {resolved['linear_kernel']}" if resolved.get("linear_kernel") else ""
        lines.append(f"Resolved once for both servers: dtype {resolved.get('dtype')}{why}, "
                     f"{_threads(resolved.get('num_threads'))}{linears}.")
    names = list(conds)
    return lines, mismatches(conds[names[0]], conds[names[1]]) if len(names) == 2 else []


# ---- the report ----------------------------------------------------------------------------

def workload_line(cfg: BenchConfig, groups: list[StackRun]) -> str:
    spec = build_source(cfg).spec if not cfg.trace else {}
    what = (f"trace {cfg.trace}" if cfg.trace else
            f"synthetic agentic, scale {cfg.scale} ({spec.get('turns')} turns, contexts up to "
            f"{spec.get('max_context_tokens')} tokens, tool results {spec.get('tool_result_tokens')} tokens)")
    n = sum(len(pr.latencies) for g in groups for runs in g.points.values() for pr in runs)
    loads = ", ".join(p.label for p in cfg.load_points())
    return (f"Workload: {what}; mode {cfg.mode}, seed {cfg.seed}; load points {loads}; "
            f"{n} tasks measured in all, in interleaved rounds (A B, B A, ...), the same tasks on both sides.")


def stack_items(groups: list[StackRun], targets) -> list[tuple[str, str, list[tuple[str, str, str]]]]:
    """(name, description, [(target, role, flags)]) per stack; empty for servers as given."""
    return [(g.name, g.stack.description,
             [(t.name, t.role, " ".join(g.flags[t.name]) or "(defaults)") for t in targets])
            for g in groups if g.stack is not None]


def stack_lines_md(groups, targets) -> list[str]:
    items = stack_items(groups, targets)
    if not items:
        return ["Servers as given (no stacks)."]
    return [f"**{name}** — {desc}. " + "; ".join(f"{t} ({role}): `{flags}`" for t, role, flags in sides)
            for name, desc, sides in items]


def stack_list_html(groups, targets) -> str:
    esc = report_html.html.escape
    items = stack_items(groups, targets)
    if not items:
        return "<p>Servers as given (no stacks).</p>"
    return "<ul>" + "".join(
        f"<li><b>{esc(name)}</b> — {esc(desc)}. " + "; ".join(
            f"{esc(t)} ({esc(role)}): <code>{esc(flags)}</code>" for t, role, flags in sides) + "</li>"
        for name, desc, sides in items) + "</ul>"


def write_compare(targets, groups: list[StackRun], cfg: BenchConfig, out_dir: Path, roles_how: str,
                  attribution: list[str], calibrations: dict | None = None, resolved: dict | None = None,
                  counterfactual: dict | None = None) -> dict:
    na, nb = targets[0].name, targets[1].name
    hyb = next(t for t in targets if t.role == "hybrid").name
    std = next(t for t in targets if t.role == "standard").name
    plain = len(groups) == 1 and groups[0].stack is None
    load_name = "concurrency" if cfg.concurrency else "request rate"
    findings = findings_of(targets, groups)
    first_load = min((f.load for f in findings), default=None)
    steps = waterfall([(f.stack, f) for f in findings if f.load == first_load]) if not plain else []
    per_stack = stack_conditions(targets, groups)
    conds = per_stack[0][1] if per_stack else {t.name: server_conditions(None) for t in targets}
    cond_lines, unequal = conditions_lines(conds, resolved)
    later_lines, later_unequal = later_stack_conditions(per_stack)
    cond_lines, unequal = cond_lines + later_lines, unequal + later_unequal
    mechanisms = {g.name: g.stack.mechanism for g in groups if g.stack}
    measured = [partition_sentence(t, g.name, pr.point.label, pr.partition)
                for g in groups for t, runs in g.points.items() for pr in runs[:1] if pr.partition]
    text = explain_stacks(findings, hyb, std, load_name, steps, measured + attribution, mechanisms, unequal)
    answer = text[0]
    rows: dict[str, list] = {}
    detail: list[str] = []
    for g in groups:
        pairs = [(load_of(pa.point), pa.summary, pb.summary) for pa, pb in zip(g.points[na], g.points[nb])]
        for load, sa, sb in pairs:
            rows[f"{load}" if plain else f"{g.name}/{load}"] = compare_rows(sa, sb)
        detail += [f"{'' if plain else g.name + ': '}{line}" for line in explain(na, nb, pairs, cfg.mode)]
    explanation = (detail[:1] + text + detail[1:]) if plain else (text + detail)
    n_tasks = sum(len(pr.latencies) for g in groups for runs in g.points.values() for pr in runs)
    head, table_rows = stack_table(targets, groups, findings)
    a_head, a_rows = attribution_table(groups)
    s_head, s_rows = schedule_table(groups)
    sim_tab = simulation_table(groups)
    ratios = simulated_ratios(findings, groups, hyb, std)
    ratio_tab, cf_tab = ratio_table(ratios), counterfactual_table(counterfactual)
    idle = idle_peer_cost(groups)
    md = [f"# flashlane compare — {na} (A) vs {nb} (B)", "", f"**Answer:** {answer}", "",
          "Serving conditions: " + "; ".join(cond_lines) + (f" **Unequal: {', '.join(unequal)}.**" if unequal else ""),
          "", workload_line(cfg, groups), f"Roles: {hyb} hybrid, {std} standard, {roles_how}.", ""]
    md += [f"- {line}" for line in stack_lines_md(groups, targets)] + [""]
    md += ["## Per stack", "", report_md.md_table(head, table_rows), ""]
    if a_rows:
        md += ["## Where a task's time goes (measured: client records + engine step records)", "",
               report_md.md_table(a_head, a_rows), ""]
    if sim_tab[1]:
        md += ["## Simulated beside measured (the same rounds replayed by `flashlane simulate`)", "",
               simulation_note(calibrations), "", report_md.md_table(*sim_tab), ""]
        if ratio_tab[1]:
            md += [report_md.md_table(*ratio_tab), ""]
    if cf_tab[1]:
        md += [f"## Counterfactual waterfall (simulated, from {counterfactual['stack']} at {counterfactual['load']})",
               "", report_md.md_table(*cf_tab), ""] + [f"- not simulated: {x}" for x in counterfactual["not_simulated"]]
        md += [""]
    md += ["## Schedule (rounds in the order run)", "", idle_note(idle), "", report_md.md_table(s_head, s_rows), ""]
    for key, rs in rows.items():
        title = f"{load_name} {key}" if plain else f"{key.split('/')[0]} — {load_name} {key.split('/')[1]}"
        md += [f"## {title}", "",
               report_md.md_table(["metric", f"A: {na}", f"B: {nb}", "A / B"], [list(r) for r in rs]), ""]
    md += ["## Where the difference comes from", ""] + [f"- {line}" for line in explanation] + [""]
    (out_dir / "compare.md").write_text("\n".join(md))
    (out_dir / "compare.json").write_text(json.dumps({
        "a": na, "b": nb, "hybrid": hyb, "standard": std, "roles": roles_how, "load": load_name,
        "answer": answer, "tasks_measured": n_tasks, "rows": rows, "explanation": explanation,
        "calibrations": calibrations, "conditions": conds, "conditions_resolved": resolved,
        "simulated_ratios": ratios, "counterfactual": counterfactual,
        "unequal_conditions": unequal, "idle_peer_cost": idle,
        "stacks": [{"name": g.name, "description": g.stack.description if g.stack else None,
                    "mechanism": g.stack.mechanism if g.stack else None, "flags": g.flags} for g in groups],
        "findings": [{"stack": f.stack, "load": f.load, "ratio": f.ratio, "ci": f.ci, "verdict": f.verdict,
                      "noisy": f.noisy, "pairs": f.pairs, "engine": f.engine, "cpu": f.cpu,
                      "disagreement": disagreement(f), "hybrid_task_s": f.hybrid_latencies,
                      "standard_task_s": f.standard_latencies} for f in findings],
        "waterfall": steps, "waterfall_load": first_load,
        "points": {f"{'' if plain else g.name + '/'}{t}": [
            {"label": pr.point.label, "folder": str(pr.run_dir), **sweep_points([(pr.point, pr.summary)])[0],
             "measured": pr.components, "attribution": pr.partition, "simulated": pr.simulated,
             "machine_load": pr.machine, "rounds": [rr.to_json() for rr in pr.rounds]}
            for pr in runs] for g in groups for t, runs in g.points.items()}}, indent=2, default=str))
    write_html(targets, groups, cfg, out_dir, answer, explanation, (head, table_rows), rows, steps, first_load,
               hyb, std, roles_how, plain, cond_lines, unequal, (a_head, a_rows), (s_head, s_rows),
               sim_tab, ratio_tab, cf_tab, calibrations, idle)
    return {"rows": rows, "explanation": explanation, "answer": answer, "a": na, "b": nb,
            "findings": findings, "waterfall": steps, "tasks_measured": n_tasks, "markdown": "\n".join(md)}


def simulation_note(calibrations: dict | None) -> str:
    """Which step-cost calibrations the simulation used, and how well each fitted its own grid."""
    if not calibrations:
        return "Step costs: no calibration recorded."
    parts = []
    for name, c in calibrations.items():
        fit = (c.get("fit") or {}).get("all") or {}
        fe = c.get("front_end")
        parts.append(f"{c['model']}: `{name}` ({c.get('machine')}; {c['mode'].get('dtype')}, "
                     f"{c['mode'].get('num_threads')} thread(s); fit on its grid: median |error| "
                     f"{100 * fit.get('median_rel_error', float('nan')):.1f}%, p90 "
                     f"{100 * fit.get('p90_rel_error', float('nan')):.1f}%; front end "
                     + ("measured" if fe else "not measured") + ")")
    return ("Step costs from `flashlane calibrate` of this machine in the servers' mode (a grid of its own, not "
            "these runs): " + "; ".join(parts) + ". Errors are simulated minus measured, over measured; "
            "the per-step error prices every measured step record as the simulation prices a served step "
            "(the step-cost model times the calibration's served-step scales). Each side is simulated at the "
            "machine's speed during its rounds: the probes before and after each of its rounds (a prefill-sized "
            "matmul, a weight read beyond the L3, a few thousand small ops, in the servers' dtype and threads) "
            "against the same "
            "probe taken while the calibration ran scales the step costs' FLOP rate, bandwidth and host terms; "
            "the last column is the error without that scaling.")


def idle_note(idle: dict | None) -> str:
    if not idle:
        return "No per-round CPU counters were read (URL targets without a local process)."
    frac = idle["fraction"]
    return (f"While one server ran a round, the other one (idle, up) used {fmt(idle['idle_cpu_s'])} CPU-s in "
            f"all, against {fmt(idle['active_cpu_s'])} CPU-s of the active ones"
            + (f" ({100 * frac:.2f}%)." if frac is not None else "."))


def write_html(targets, groups, cfg, out_dir: Path, answer, explanation, stack_tab, rows, steps, first_load,
               hyb, std, roles_how, plain, cond_lines, unequal, attr_tab, sched_tab, sim_tab, ratio_tab, cf_tab,
               calibrations, idle) -> None:
    esc = report_html.html.escape
    na, nb = targets[0].name, targets[1].name
    load_name = "concurrency" if cfg.concurrency else "request rate"
    cond_html = "<ul>" + "".join(f"<li>{esc(x)}</li>" for x in cond_lines) + "</ul>" + (
        f"<p class='bad'><b>Unequal conditions: {esc(', '.join(unequal))}.</b></p>" if unequal else "")
    sections = [("Answer", f"<p><b>{esc(answer)}</b></p><p class='note'>{esc(workload_line(cfg, groups))} "
                           f"Roles: {esc(hyb)} hybrid, {esc(std)} standard, {esc(roles_how)}.</p>"),
                ("Serving conditions", cond_html),
                ("Stacks", stack_list_html(groups, targets)),
                ("Per stack", report_html.table(*stack_tab))]
    if attr_tab[1]:
        sections.append(("Where a task's time goes (measured)", report_html.table(*attr_tab)))
    if sim_tab[1]:
        sections.append(("Simulated beside measured",
                         f"<p class='note'>{esc(simulation_note(calibrations))}</p>" + report_html.table(*sim_tab)
                         + (report_html.table(*ratio_tab) if ratio_tab[1] else "")))
    if cf_tab[1]:
        sections.append(("Counterfactual waterfall (simulated)", report_html.table(*cf_tab)))
    if steps:
        title = f"{hyb} / {std} per-task latency ratio by stack at {load_name} {first_load:g}"
        sections.append((f"Waterfall at {load_name} {first_load:g}",
                         report_html.img(plots.ratio_waterfall(steps, hyb, std, title=title), "ratio waterfall")))
    sections.append(("Where the difference comes from",
                     "<ul>" + "".join(f"<li>{esc(x)}</li>" for x in explanation) + "</ul>"))
    sections.append(("Schedule (rounds in the order run)",
                     f"<p class='note'>{esc(idle_note(idle))}</p>" + report_html.table(*sched_tab)))
    links = []
    for g in groups:
        for t, runs in g.points.items():
            for pr in runs:
                for rr in pr.rounds:
                    rel = os.path.relpath(rr.run_dir / "report.html", out_dir)
                    links.append(f"<li><a href='{esc(rel)}'>{esc(('' if plain else g.name + ' / ') + t + ' ' + pr.point.label + f' round {rr.index}')}</a></li>")
    sections.append(("Per-run reports", "<ul>" + "".join(links) + "</ul>"))
    for key, rs in rows.items():
        title = f"{load_name} {key}" if plain else f"{key.split('/')[0]} — {load_name} {key.split('/')[1]}"
        sections.append((title, report_html.table(["metric", f"A: {na}", f"B: {nb}", "A / B"], [list(r) for r in rs])))
    for g in groups:
        prefix = "" if plain else f"{g.name}: "
        sections.append((f"{prefix}tasks/hour, p90 task latency and throughput vs load", report_html.img(
            plots.sweep({t: sweep_points([(pr.point, pr.summary) for pr in runs]) for t, runs in g.points.items()},
                        x_label=LOAD_AXIS if cfg.concurrency else "request rate (sessions / s)"), "sweep")))
        for pa, pb in zip(g.points[na], g.points[nb]):
            cdfs = {}
            for t, pr in ((na, pa), (nb, pb)):
                cdfs[t] = cdf_series(read_requests(pr.run_dir / "requests.jsonl"),
                                     read_sessions(pr.run_dir / "sessions.jsonl"))
            sections.append((f"{prefix}latency CDFs at {pa.point.label}", report_html.img(plots.latency_cdfs(cdfs), "CDFs")))
    (out_dir / "report.html").write_text(report_html.page(f"flashlane compare — {na} vs {nb}", sections))


