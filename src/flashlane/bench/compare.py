"""`flashlane compare`: the same seeded agentic workload on two targets, side by side.

A target is a base URL (used as is) or a model id (started here with `flashlane serve` on a free
port, same engine settings for both, and always stopped afterwards). Load points are interleaved
(A c1, B c1, A c2, ...) so slow drift of the machine hits both alike.
"""

from __future__ import annotations

import contextlib
import json
import re
import signal
from dataclasses import dataclass, replace
from pathlib import Path

import httpx

from . import plots, report_html, report_md
from .explain import explain
from .report_rows import fmt, ms
from .runner import BenchConfig, build_source, cdf_series, run_point, sweep_points
from .records import read_requests, read_sessions
from .server_launch import ServerProcess, free_port, serve_command
from .text_synth import TextSynth, TokenizerResolver, load_tokenizer


@dataclass
class CompareTarget:
    spec: str  # what the user gave
    name: str
    base_url: str | None = None
    model: str | None = None  # to start, or served model name
    server: ServerProcess | None = None


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


def ratio(a, b):
    return a / b if a is not None and b not in (None, 0) else None


def compare_rows(sa: dict, sb: dict) -> list[tuple[str, str, str, str]]:
    """(metric, A, B, A/B) in the seed study's terms."""
    def line(label, va, vb, show=fmt):
        r = ratio(va, vb)
        return (label, show(va), show(vb), f"{r:.2f}×" if r is not None else "–")

    def gaps(s):
        g = (s.get("telemetry") or {}).get("idle_gaps")
        if not g:
            return "–"
        return f"{g['count']} / {fmt(g['total_s'])} s (" + ", ".join(
            f"{c} {fmt(v['total_s'])}s" for c, v in g["by_class"].items()) + ")"

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
        rows.append(("idle gaps: count / time (by class)", gaps(sa), gaps(sb), "–"))
    rows.append(("errors", str(sa["errors"]["total"]), str(sb["errors"]["total"]), "–"))
    rows.append(("valid", "yes" if sa["validity"]["valid"] else "no",
                 "yes" if sb["validity"]["valid"] else "no", "–"))
    return rows


def start_targets(targets: list[CompareTarget], out_dir: Path, stack: contextlib.ExitStack,
                  template: str | None, extra_args: list[str], startup_timeout_s: float, log) -> None:
    for t in targets:
        if t.base_url:
            continue
        port = free_port()
        cmd = serve_command(t.model, port, template, extra_args)
        t.base_url = f"http://127.0.0.1:{port}"
        log(f"starting {t.model} on port {port}")
        t.server = ServerProcess(cmd, t.base_url, out_dir / t.name / "server.log", startup_timeout_s)
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


def run_compare(a: str, b: str, base_cfg: BenchConfig, out_dir: Path, template: str | None = None,
                extra_args: list[str] | None = None, startup_timeout_s: float = 300.0,
                log=print, resolve_tokenizer: TokenizerResolver | None = None) -> dict:
    """Run the comparison; returns {'rows': {load: rows}, 'explanation': [...], 'dirs': ...}.
    `resolve_tokenizer`: see `prompt_synth`."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    targets = resolve_targets(a, b)
    source = build_source(base_cfg)
    results: dict[str, list] = {t.name: [] for t in targets}
    previous = signal.getsignal(signal.SIGTERM)

    def on_term(*_):
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_term)
    try:
        with contextlib.ExitStack() as stack:
            start_targets(targets, out_dir, stack, template, extra_args or [], startup_timeout_s, log)
            base_cfg, synth = prompt_synth(base_cfg, targets, resolve_tokenizer)
            cfgs = {t.name: replace(base_cfg, base_url=t.base_url, model=served_model(t),
                                    server_pid=t.server.pid if t.server else base_cfg.server_pid,
                                    server_command=t.server.command if t.server else None)
                    for t in targets}
            for point in base_cfg.load_points():
                for t in targets:
                    log(f"{t.name} {point.label}")
                    run_dir = out_dir / t.name / point.label
                    s = run_point(cfgs[t.name], source, synth, point, run_dir)
                    results[t.name].append((point, s, run_dir))
    finally:
        signal.signal(signal.SIGTERM, previous)
    return write_compare(targets, results, base_cfg, out_dir)


def write_compare(targets, results, cfg: BenchConfig, out_dir: Path) -> dict:
    na, nb = targets[0].name, targets[1].name
    pairs = [(p.concurrency if p.concurrency is not None else p.request_rate, sa, sb)
             for (p, sa, _), (_, sb, _) in zip(results[na], results[nb])]
    rows = {f"{pt}": compare_rows(sa, sb) for pt, sa, sb in pairs}
    text = explain(na, nb, pairs, cfg.mode)
    load_name = "concurrency" if cfg.concurrency else "request rate"
    md = [f"# flashlane compare — {na} (A) vs {nb} (B)", "",
          f"Workload: agentic ({'trace ' + cfg.trace if cfg.trace else 'synthetic, scale ' + cfg.scale}), "
          f"mode {cfg.mode}, seed {cfg.seed}; {load_name} {', '.join(k for k in rows)}.", ""]
    for load, rs in rows.items():
        md += [f"## {load_name} {load}", "",
               report_md.md_table(["metric", f"A: {na}", f"B: {nb}", "A / B"], [list(r) for r in rs]), ""]
    md += ["## Where the difference comes from", ""] + [f"- {line}" for line in text] + [""]
    (out_dir / "compare.md").write_text("\n".join(md))
    (out_dir / "compare.json").write_text(json.dumps(
        {"a": na, "b": nb, "load": load_name, "rows": rows, "explanation": text,
         "points": {t: [{"label": p.label, "folder": str(d), **sweep_points([(p, s)])[0]}
                        for p, s, d in results[t]] for t in (na, nb)}}, indent=2))
    figs = {"Tasks/hour, p90 task latency and throughput vs load": plots.sweep(
        {t: sweep_points([(p, s) for p, s, _ in results[t]]) for t in (na, nb)})}
    for (p, _, da), (_, _, db) in zip(results[na], results[nb]):
        figs[f"Latency CDFs at {p.label}"] = plots.latency_cdfs({
            na: cdf_series(read_requests(da / "requests.jsonl"), read_sessions(da / "sessions.jsonl")),
            nb: cdf_series(read_requests(db / "requests.jsonl"), read_sessions(db / "sessions.jsonl"))})
    sections = []
    for load, rs in rows.items():
        sections.append((f"{load_name} {load}", report_html.table(
            ["metric", f"A: {na}", f"B: {nb}", "A / B"], [list(r) for r in rs])))
    sections.append(("Where the difference comes from",
                     "<ul>" + "".join(f"<li>{report_html.html.escape(x)}</li>" for x in text) + "</ul>"))
    sections += [(n, report_html.img(p, n)) for n, p in figs.items()]
    (out_dir / "report.html").write_text(report_html.page(f"flashlane compare — {na} vs {nb}", sections))
    return {"rows": rows, "explanation": text, "a": na, "b": nb, "markdown": "\n".join(md)}
