"""`flashlane compare`: the same seeded agentic workload on two targets, side by side, under
named serving stacks (bench/stacks.py), with a CI on every ratio and an attributed answer.

A target is a base URL (used as is) or a model id (started here with `flashlane serve` on a free
port and always stopped afterwards). With stacks, each (stack, model) is its own server started
with that stack's flags for the model's role (hybrid or standard); URL targets cannot take stacks,
so then only the given servers run. Load points are interleaved (A c1, B c1, A c2, ...) so slow
drift of the machine hits both alike.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable

import httpx

from . import plots, report_html, report_md
from .explain import explain, explain_stacks, prediction_sentence, ratio_words
from .findings import PointFinding, point_finding, waterfall
from .layer_profile import breakdown_sentence
from .load import LoadPoint
from .machine_load import MachineLoad
from .records import read_requests, read_sessions
from .report_rows import fmt, ms
from .runner import BenchConfig, build_source, cdf_series, run_point, sweep_points
from .server_launch import ServerProcess, free_port, serve_command
from .stacks import ROLES, Stack
from .task_components import measured_components, replayed_turns, task_latencies
from .text_synth import TextSynth, TokenizerResolver, load_tokenizer

LOAD_AXIS = "concurrency (sessions in flight)"
# (model id, replayed turns per task, concurrency) -> {prefill_s, decode_s, task_s} or None
Predictor = Callable[[str, list, int], "dict | None"]
# (model id, batch, context, weights dtype as served or None) -> the profile command's JSON summary, or None
Profiler = Callable[[str, int, int, "str | None"], "dict | None"]


@dataclass
class CompareTarget:
    spec: str  # what the user gave
    name: str
    base_url: str | None = None
    model: str | None = None  # to start, or served model name
    server: ServerProcess | None = None
    role: str = "hybrid"


@dataclass
class PointRun:
    point: LoadPoint
    summary: dict
    run_dir: Path
    latencies: list[float]
    components: dict | None
    turns: list
    machine: dict
    prediction: dict | None = None


@dataclass
class StackRun:
    name: str  # stack name, or "as given" without stacks
    stack: Stack | None
    flags: dict[str, list[str]] = field(default_factory=dict)  # target name -> stack flags
    points: dict[str, list[PointRun]] = field(default_factory=dict)  # target name -> per point


def is_url(s: str) -> bool:
    return s.startswith("http://") or s.startswith("https://")


def safe_name(s: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "_", s.replace("http://", "").replace("https://", "")).strip("_")


def resolve_targets(a: str, b: str) -> list[CompareTarget]:
    out = []
    for spec in (a, b):
        if is_url(spec):
            out.append(CompareTarget(spec, safe_name(spec), base_url=spec.rstrip("/")))
        else:
            out.append(CompareTarget(spec, safe_name(spec), model=spec))
    if out[0].name == out[1].name:
        out[0].name, out[1].name = out[0].name + "-A", out[1].name + "-B"
    return out


def assign_roles(targets: list[CompareTarget], role_of: Callable[[str], str | None] | None) -> str:
    """Hybrid / standard role of each target: from `role_of(model id)` (the CLI reads the model's
    config: linear-attention layers make it hybrid) when that tells the two apart, else by
    position (A hybrid, B standard). Returns how the roles were decided."""
    found = [role_of(t.model) if role_of and t.model and not is_url(t.spec) else None for t in targets]
    if sorted(r for r in found if r) == sorted(ROLES):
        for t, r in zip(targets, found):
            t.role = r
        return "from the models' configs"
    targets[0].role, targets[1].role = ROLES
    return "by position (A hybrid, B standard)"


def ratio(a, b):
    return a / b if a is not None and b not in (None, 0) else None


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
    ca = (sa.get("server_info") or {}).get("cache_bytes_per_token")
    cb = (sb.get("server_info") or {}).get("cache_bytes_per_token")
    if ca is not None or cb is not None:
        rows.append(line("cache bytes / token", ca, cb))
    xa = (sa.get("server_info") or {}).get("state_bytes_per_sequence")
    xb = (sb.get("server_info") or {}).get("state_bytes_per_sequence")
    if xa is not None or xb is not None:
        rows.append(line("state bytes / sequence", xa, xb))
    if ta.get("busy_overall") is not None or tb.get("busy_overall") is not None:
        rows.append(line("utilisation (busy fraction)", ta.get("busy_overall"), tb.get("busy_overall")))
        rows.append(("idle gaps: count / time (by class)", _gaps(sa), _gaps(sb), "–"))
    rows.append(("errors", str(sa["errors"]["total"]), str(sb["errors"]["total"]), "–"))
    rows.append(("valid", "yes" if sa["validity"]["valid"] else "no",
                 "yes" if sb["validity"]["valid"] else "no", "–"))
    return rows


def launch_command(t: CompareTarget, port: int, template: str | None, extra_args: list[str],
                   flags: list[str]) -> list[str]:
    """The server command for one (stack, model): a template's command gets the stack flags
    appended; the default `flashlane serve` gets --serve-arg extras, then the stack's flags."""
    if template:
        return serve_command(t.model, port, template) + flags
    return serve_command(t.model, port, None, list(extra_args) + flags)


def start_targets(targets: list[CompareTarget], folder: Path, stack: contextlib.ExitStack,
                  template: str | None, extra_args: list[str], startup_timeout_s: float, log,
                  flags: dict[str, list[str]] | None = None) -> None:
    for t in targets:
        if is_url(t.spec):
            continue
        port = free_port()
        own = (flags or {}).get(t.name, [])
        cmd = launch_command(t, port, template, extra_args, own)
        t.base_url = f"http://127.0.0.1:{port}"
        log(f"starting {t.model} on port {port}" + (f" with {' '.join(own)}" if own else ""))
        t.server = ServerProcess(cmd, t.base_url, folder / t.name / "server.log", startup_timeout_s)
        stack.callback(t.server.stop)
        t.server.start()
        log(f"{t.model} healthy at {t.base_url} (pid {t.server.pid})")


def served_model(t: CompareTarget) -> str | None:
    if t.model and not is_url(t.spec):
        try:
            data = httpx.get(t.base_url + "/v1/models", timeout=5).json().get("data", [])
            ids = [m.get("id") for m in data]
            if t.model in ids or not ids:
                return t.model
            return ids[0]
        except (httpx.HTTPError, ValueError):
            return t.model
    return None  # URL target: the runner takes the first model it lists


def prompt_synth(cfg: BenchConfig, targets: list[CompareTarget],
                 resolve: TokenizerResolver | None = None) -> tuple[BenchConfig, TextSynth]:
    """One text synthesizer for both targets (identical prompts): the given tokenizer, else the
    first target whose model id is a folder with a tokenizer or a name `resolve` maps to one (the
    CLI's preset resolver; called after the servers are up, as they create presets), else the
    approximation."""
    tok = load_tokenizer(cfg.tokenizer, resolve) if cfg.tokenizer else None
    if tok is None:
        for t in targets:
            if t.model and not is_url(t.spec):
                try:
                    tok = load_tokenizer(t.model, resolve)
                except ValueError:
                    continue
                cfg = replace(cfg, tokenizer=t.model)
                break
    return cfg, TextSynth(seed=cfg.seed, tokenizer=tok)


def measure_point(cfg: BenchConfig, source, synth, point: LoadPoint, run_dir: Path,
                  server_pids: list[int]) -> PointRun:
    with MachineLoad(server_pids) as load:
        summary = run_point(cfg, source, synth, point, run_dir)
    machine = load.summary()
    (run_dir / "machine_load.json").write_text(json.dumps(machine, indent=2))
    records = read_requests(run_dir / "requests.jsonl")
    sessions = read_sessions(run_dir / "sessions.jsonl")
    return PointRun(point, summary, run_dir, task_latencies(sessions),
                    measured_components(records, sessions), replayed_turns(records, sessions), machine)


def run_compare(a: str, b: str, base_cfg: BenchConfig, out_dir: Path, template: str | None = None,
                extra_args: list[str] | None = None, startup_timeout_s: float = 300.0,
                log=print, resolve_tokenizer: TokenizerResolver | None = None,
                stacks: list[Stack] | None = None, role_of: Callable[[str], str | None] | None = None,
                predict: Predictor | None = None, profile: Profiler | None = None,
                hardware: dict | None = None) -> dict:
    """Run the comparison under each stack (None or URL targets: the servers as given); returns
    {'rows', 'explanation', 'answer', 'markdown', ...}. `resolve_tokenizer`: see `prompt_synth`;
    `role_of`: see `assign_roles`; `predict` / `profile`: attribution hooks (the CLI wires
    `analyze` and `flashlane profile`); `hardware`: the calibrated profile, stored with the run."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    targets = resolve_targets(a, b)
    roles_how = assign_roles(targets, role_of)
    if stacks and any(is_url(t.spec) for t in targets):
        log("compare: URL targets cannot take stacks; only the given servers run")
        stacks = None
    groups = ([StackRun(s.name, s, {t.name: s.flags(t.role) for t in targets}) for s in stacks]
              if stacks else [StackRun("as given", None)])
    if hardware is not None:
        (out_dir / "hardware_local.json").write_text(json.dumps(hardware, indent=2))
    source = build_source(base_cfg)
    synth = None
    previous = signal.getsignal(signal.SIGTERM)

    def on_term(*_):
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_term)
    try:
        for g in groups:
            folder = out_dir / g.name if g.stack else out_dir
            g.points = {t.name: [] for t in targets}
            with contextlib.ExitStack() as servers:
                if g.stack:
                    log(f"stack {g.name}")
                start_targets(targets, folder, servers, template, extra_args or [], startup_timeout_s,
                              log, g.flags)
                if synth is None:
                    base_cfg, synth = prompt_synth(base_cfg, targets, resolve_tokenizer)
                cfgs = {t.name: replace(base_cfg, base_url=t.base_url, model=served_model(t),
                                        server_pid=t.server.pid if t.server else base_cfg.server_pid,
                                        server_command=t.server.command if t.server else None)
                        for t in targets}
                pids = [t.server.pid for t in targets if t.server]
                for point in base_cfg.load_points():
                    for t in targets:
                        log(f"{g.name + ' ' if g.stack else ''}{t.name} {point.label}")
                        pr = measure_point(cfgs[t.name], source, synth, point,
                                           folder / t.name / point.label, pids)
                        g.points[t.name].append(pr)
    finally:
        signal.signal(signal.SIGTERM, previous)
    attribution = attribute(targets, groups, predict, profile, out_dir, log)
    return write_compare(targets, groups, base_cfg, out_dir, roles_how, attribution, hardware)


def attribute(targets, groups: list[StackRun], predict: Predictor | None, profile: Profiler | None,
              out_dir: Path, log) -> list[str]:
    """Predicted-vs-measured sentences per (stack, model) at the first load point, and one
    per-layer-type profile sentence per model at the workload's batch and median final context."""
    lines = []
    for g in groups:
        for t in targets:
            runs = g.points.get(t.name) or []
            if not runs or not t.model or is_url(t.spec) or predict is None:
                continue
            for pr in runs:
                if pr.turns:
                    pr.prediction = predict(t.model, pr.turns, pr.point.concurrency or 1)
            first = runs[0]
            if first.prediction and first.components:
                lines.append(prediction_sentence(t.name, g.name, first.prediction, first.components))
    if profile is None:
        return lines
    for t in targets:
        if not t.model or is_url(t.spec):
            continue
        runs = [pr for g in groups for pr in g.points.get(t.name, [])]
        contexts = [max(i + o for i, _, o in task) for pr in runs for task in pr.turns if task]
        if not contexts:
            continue
        batch = max(pr.point.concurrency or 1 for pr in runs)
        context = sorted(contexts)[len(contexts) // 2]  # a typical task's final context
        dtype = next((pr.summary.get("server_info", {}).get("dtype") for pr in runs), None)
        log(f"profiling {t.model} at batch {batch}, context {context}" + (f", {dtype} as served" if dtype else ""))
        doc = profile(t.model, batch, context, dtype)
        if doc is None:
            continue
        (out_dir / "profile").mkdir(exist_ok=True)
        (out_dir / "profile" / f"{t.name}.json").write_text(json.dumps(doc, indent=2))
        try:
            lines.append(breakdown_sentence(t.name, {"batch": batch, "context": context, **doc}))
        except ValueError as exc:
            lines.append(f"The profile of {t.name} could not be read: {exc}.")
    return lines


def findings_of(targets, groups: list[StackRun], cfg: BenchConfig) -> list[PointFinding]:
    hyb = next(t for t in targets if t.role == "hybrid")
    std = next(t for t in targets if t.role == "standard")
    out = []
    for g in groups:
        for ph, ps in zip(g.points[hyb.name], g.points[std.name]):
            noisy = [f"{t.name}: {r}" for t, pr in ((hyb, ph), (std, ps)) for r in pr.machine.get("reasons", [])]
            load = ph.point.concurrency if ph.point.concurrency is not None else ph.point.request_rate
            out.append(point_finding(g.name, load, ph.latencies, ps.latencies, n_boot=max(cfg.n_boot, 2000),
                                     seed=cfg.seed, noisy=noisy))
    return out


def _pair(pa: PointRun, pb: PointRun, fn) -> str:
    return f"{fn(pa.summary)} / {fn(pb.summary)}"


def stack_table(targets, groups: list[StackRun], findings: list[PointFinding]) -> tuple[list[str], list[list[str]]]:
    """The closing-note table: one row per (stack, load point), hybrid / standard in each cell."""
    hyb = next(t for t in targets if t.role == "hybrid")
    std = next(t for t in targets if t.role == "standard")
    head = ["stack", "load", f"{hyb.name} / {std.name} per-task latency (95% CI)",
            "tasks/h", "p90 task (s)", "TTFT mean", "ITL mean", "prefix-cache hit", "idle gaps by class", "noisy"]
    by_key = {(f.stack, f.load): f for f in findings}
    rows = []
    for g in groups:
        for ph, ps in zip(g.points[hyb.name], g.points[std.name]):
            load = ph.point.concurrency if ph.point.concurrency is not None else ph.point.request_rate
            f = by_key[(g.name, load)]
            rows.append([g.name, f"{load:g}", ratio_words(f),
                         _pair(ph, ps, lambda s: fmt(s["tasks_per_hour"])),
                         _pair(ph, ps, lambda s: fmt(s["task_latency_s"]["p90"])),
                         _pair(ph, ps, lambda s: ms(s["ttft_s"]["mean"])),
                         _pair(ph, ps, lambda s: ms(s["itl_s"]["mean"])),
                         _pair(ph, ps, lambda s: fmt(s["cache"].get("prefix_cache_hit_rate"))),
                         _pair(ph, ps, _gaps), "yes" if f.noisy else "no"])
    return head, rows


def prediction_table(groups: list[StackRun]) -> tuple[list[str], list[list[str]]]:
    """analyze's prediction beside the measurement, per task and component; the residual of the
    time outside think/tool waits is serving overhead (dispatch, scheduling, idle)."""
    head = ["stack", "model", "load", "prefill predicted / measured (s)", "decode predicted / measured (s)",
            "model time predicted (s)", "task minus think/tool, measured (s)", "residual: serving overhead (s)"]
    rows = []
    for g in groups:
        for t, runs in g.points.items():
            for pr in runs:
                p, m = pr.prediction, pr.components
                if not p or not m:
                    continue
                busy = m["task_s"] - m["think_s"]
                rows.append([g.name, t, pr.point.label, f"{fmt(p['prefill_s'])} / {fmt(m['prefill_s'])}",
                             f"{fmt(p['decode_s'])} / {fmt(m['decode_s'])}", fmt(p["task_s"]), fmt(busy),
                             fmt(busy - p["task_s"])])
    return head, rows


def workload_line(cfg: BenchConfig, groups: list[StackRun], targets) -> str:
    spec = build_source(cfg).spec if not cfg.trace else {}
    what = (f"trace {cfg.trace}" if cfg.trace else
            f"synthetic agentic, scale {cfg.scale} ({spec.get('turns')} turns, contexts up to "
            f"{spec.get('max_context_tokens')} tokens, tool results {spec.get('tool_result_tokens')} tokens)")
    n = sum(len(pr.latencies) for g in groups for runs in g.points.values() for pr in runs)
    loads = ", ".join(p.label for p in cfg.load_points())
    return (f"Workload: {what}; mode {cfg.mode}, seed {cfg.seed}; load points {loads}; "
            f"{n} tasks measured in all.")


def stack_lines(groups: list[StackRun], targets) -> list[str]:
    out = []
    for g in groups:
        if g.stack is None:
            out.append("Servers as given (no stacks).")
            continue
        flags = "; ".join(f"{t.name} ({t.role}): `{' '.join(g.flags[t.name]) or '(defaults)'}`" for t in targets)
        out.append(f"**{g.name}** — {g.stack.description}. {flags}")
    return out


def write_compare(targets, groups: list[StackRun], cfg: BenchConfig, out_dir: Path, roles_how: str,
                  attribution: list[str], hardware: dict | None = None) -> dict:
    na, nb = targets[0].name, targets[1].name
    hyb = next(t for t in targets if t.role == "hybrid").name
    std = next(t for t in targets if t.role == "standard").name
    plain = len(groups) == 1 and groups[0].stack is None
    findings = findings_of(targets, groups, cfg)
    first_load = min((f.load for f in findings), default=None)
    steps = waterfall([(f.stack, f) for f in findings if f.load == first_load]) if not plain else []
    text = explain_stacks(findings, hyb, std, "concurrency" if cfg.concurrency else "request rate",
                          steps, attribution)
    answer = text[0]
    rows: dict[str, list] = {}
    detail: list[str] = []
    for g in groups:
        pairs = [(pa.point.concurrency if pa.point.concurrency is not None else pa.point.request_rate,
                  pa.summary, pb.summary) for pa, pb in zip(g.points[na], g.points[nb])]
        for load, sa, sb in pairs:
            rows[f"{load}" if plain else f"{g.name}/{load}"] = compare_rows(sa, sb)
        detail += [f"{'' if plain else g.name + ': '}{line}" for line in explain(na, nb, pairs, cfg.mode)]
    # plain A/B keeps its first line (what was replayed); with stacks the answer leads
    explanation = (detail[:1] + text + detail[1:]) if plain else (text + detail)
    load_name = "concurrency" if cfg.concurrency else "request rate"
    n_tasks = sum(len(pr.latencies) for g in groups for runs in g.points.values() for pr in runs)
    head, table_rows = stack_table(targets, groups, findings)
    md = [f"# flashlane compare — {na} (A) vs {nb} (B)", "", f"**Answer:** {answer}", "",
          workload_line(cfg, groups, targets), f"Roles: {hyb} hybrid, {std} standard, {roles_how}.", ""]
    md += [f"- {line}" for line in stack_lines(groups, targets)] + [""]
    md += ["## Per stack", "", report_md.md_table(head, table_rows), ""]
    p_head, p_rows = prediction_table(groups)
    if p_rows:
        md += ["## Predicted (analyze, local profile) vs measured, per task", "",
               report_md.md_table(p_head, p_rows), ""]
    for key, rs in rows.items():
        title = f"{load_name} {key}" if plain else f"{key.split('/')[0]} — {load_name} {key.split('/')[1]}"
        md += [f"## {title}", "",
               report_md.md_table(["metric", f"A: {na}", f"B: {nb}", "A / B"], [list(r) for r in rs]), ""]
    md += ["## Where the difference comes from", ""] + [f"- {line}" for line in explanation] + [""]
    (out_dir / "compare.md").write_text("\n".join(md))
    (out_dir / "compare.json").write_text(json.dumps({
        "a": na, "b": nb, "hybrid": hyb, "standard": std, "roles": roles_how, "load": load_name,
        "answer": answer, "tasks_measured": n_tasks, "rows": rows, "explanation": explanation,
        "hardware_local": hardware,
        "stacks": [{"name": g.name, "description": g.stack.description if g.stack else None,
                    "flags": g.flags} for g in groups],
        "findings": [{"stack": f.stack, "load": f.load, "ratio": f.ratio, "ci": f.ci, "verdict": f.verdict,
                      "noisy": f.noisy, "hybrid_task_s": f.hybrid_latencies,
                      "standard_task_s": f.standard_latencies} for f in findings],
        "waterfall": steps,
        "points": {f"{'' if plain else g.name + '/'}{t}": [
            {"label": pr.point.label, "folder": str(pr.run_dir), **sweep_points([(pr.point, pr.summary)])[0],
             "measured": pr.components, "predicted": pr.prediction, "machine_load": pr.machine}
            for pr in runs] for g in groups for t, runs in g.points.items()}}, indent=2))
    write_html(targets, groups, cfg, out_dir, answer, explanation, head, table_rows, rows, steps,
               hyb, std, roles_how, plain)
    return {"rows": rows, "explanation": explanation, "answer": answer, "a": na, "b": nb,
            "findings": findings, "waterfall": steps, "tasks_measured": n_tasks, "markdown": "\n".join(md)}


def write_html(targets, groups, cfg, out_dir: Path, answer, explanation, head, table_rows, rows, steps,
               hyb, std, roles_how, plain) -> None:
    esc = report_html.html.escape
    na, nb = targets[0].name, targets[1].name
    load_name = "concurrency" if cfg.concurrency else "request rate"
    sections = [("Answer", f"<p><b>{esc(answer)}</b></p><p class='note'>{esc(workload_line(cfg, groups, targets))} "
                           f"Roles: {esc(hyb)} hybrid, {esc(std)} standard, {esc(roles_how)}.</p>"),
                ("Stacks", "<ul>" + "".join(f"<li>{esc(x)}</li>" for x in stack_lines(groups, targets)) + "</ul>"),
                ("Per stack", report_html.table(head, table_rows))]
    p_head, p_rows = prediction_table(groups)
    if p_rows:
        sections.append(("Predicted (analyze, local profile) vs measured, per task",
                         report_html.table(p_head, p_rows)))
    if steps:
        sections.append(("Waterfall: per-task latency ratio by stack",
                         report_html.img(plots.ratio_waterfall(steps, hyb, std), "ratio waterfall")))
    sections.append(("Where the difference comes from",
                     "<ul>" + "".join(f"<li>{esc(x)}</li>" for x in explanation) + "</ul>"))
    links = []
    for g in groups:
        for t, runs in g.points.items():
            for pr in runs:
                rel = os.path.relpath(pr.run_dir / "report.html", out_dir)
                links.append(f"<li><a href='{esc(rel)}'>{esc(('' if plain else g.name + ' / ') + t + ' ' + pr.point.label)}</a></li>")
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
