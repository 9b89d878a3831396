"""Run a benchmark: one run folder per load point (manifest, records, summary, telemetry,
reports), plus a sweep-level report when there are several load points."""

from __future__ import annotations

import asyncio
import json
import sys
from collections.abc import Callable, Coroutine
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx

from . import plots, report_html, report_md
from .client import Target, fetch_json, make_client
from .clock import now
from .convert import to_inferencex, to_vllm_flat
from .idle_gaps import (busy_fractions, classify_gaps, detect_gaps, step_busy_fractions, step_gaps, step_series,
                        summarize_gaps)
from .load import LoadPoint, RunControl, run_load
from .manifest import git_sha, harness_version, host_info, utc_now
from .metrics import SummaryParams, compute_summary, e2e, tpot, ttft
from .prefix_reuse import resolve_page_size
from .progress import ProgressView
from .records import PHASE_PROFILING, write_jsonl
from .replay import BenchAbort, ReplayContext
from .stats import in_flight_series
from .telemetry import Telemetry, find_local_server_pid
from .text_synth import TextSynth, TokenizerResolver, load_tokenizer
from .workloads.agentic import agentic_source, spec_from_scale
from .workloads.fixed import FixedSpec, fixed_source
from .workloads.multiturn import MultiTurnSpec, multiturn_source
from .workloads.source import WorkloadSource

WORKLOADS = ("agentic", "multiturn", "fixed")


@dataclass
class BenchConfig:
    base_url: str
    output_dir: str
    model: str | None = None
    workload: str = "agentic"
    trace: str | None = None
    scale: str = "medium"
    agentic_overrides: dict = field(default_factory=dict)
    multiturn: MultiTurnSpec = field(default_factory=MultiTurnSpec)
    fixed: FixedSpec = field(default_factory=FixedSpec)
    mode: str = "recorded"
    endpoint: str | None = None
    tokenizer: str | None = None
    temperature: float | None = None
    seed: int = 0
    concurrency: list[int] | None = None
    request_rates: list[float] | None = None
    burstiness: float = 1.0
    max_concurrency: int | None = None
    num_sessions: int | None = None
    sessions_per_load: tuple[int, int] | None = None  # (a, b): a * concurrency + b sessions
    duration_s: float | None = None
    warmup: str = "auto"  # auto | none | tstar | requests
    warmup_requests: int | None = None
    think_cap_s: float = 10.0
    think_scale: float = 1.0
    slo: dict = field(default_factory=dict)
    max_error_rate: float = 0.01
    request_timeout_s: float = 600.0
    telemetry: bool = True
    server_pid: int | None = None
    scrape_interval_s: float = 1.0
    sample_interval_s: float = 0.2
    idle_threshold: float = 0.05
    min_gap_s: float = 0.2
    progress: bool = True
    server_command: list[str] | None = None
    argv: list[str] = field(default_factory=lambda: list(sys.argv))
    n_boot: int = 1000
    page_size: int | None = None  # prefix-cache page for the theoretical hit (default: server's, else 16)
    first_session: int = 0  # session index of the first tree (later rounds of an interleaved compare)

    def __post_init__(self):
        if not self.base_url.lower().startswith(("http://", "https://")):
            raise ValueError(f"base_url: base URL must start with http:// or https://, got {self.base_url!r}")
        if self.workload not in WORKLOADS:
            raise ValueError(f"workload: expected one of {WORKLOADS}, got {self.workload!r}")
        if self.trace and self.workload != "agentic":
            raise ValueError("trace: only the agentic workload replays trace files")
        if bool(self.concurrency) == bool(self.request_rates):
            raise ValueError("load: give exactly one of concurrency / request_rates")
        if self.page_size is not None and self.page_size < 1:
            raise ValueError(f"page_size: must be >= 1, got {self.page_size}")

    def load_points(self) -> list[LoadPoint]:
        if self.concurrency:
            return [LoadPoint(concurrency=c) for c in self.concurrency]
        return [LoadPoint(request_rate=r, burstiness=self.burstiness,
                          max_concurrency=self.max_concurrency) for r in self.request_rates]

    def control(self, point: LoadPoint) -> RunControl:
        n = self.num_sessions
        if n is None and self.duration_s is None:
            c = point.concurrency
            if self.sessions_per_load and c:
                n = self.sessions_per_load[0] * c + self.sessions_per_load[1]
            elif self.workload == "fixed":
                n = 10 * c if c else 50
            else:
                n = 3 * c if c else 10
        warm, wreq = self.warmup, 0
        if warm == "auto":
            if point.concurrency and self.workload == "agentic":
                warm = "tstar"
            elif self.workload == "fixed":
                warm = "requests"
            else:
                warm = "none"
        if warm == "requests":
            wreq = self.warmup_requests if self.warmup_requests is not None else 2 * (point.concurrency or 1)
        return RunControl(num_sessions=n, duration_s=self.duration_s, warmup=warm, warmup_requests=wreq,
                          first_index=self.first_session)


def build_source(cfg: BenchConfig) -> WorkloadSource:
    if cfg.workload == "agentic":
        spec = spec_from_scale(cfg.scale, **cfg.agentic_overrides)
        return agentic_source(cfg.seed, spec=spec, trace_file=cfg.trace, scale=cfg.scale)
    if cfg.workload == "multiturn":
        return multiturn_source(cfg.seed, cfg.multiturn)
    return fixed_source(cfg.seed, cfg.fixed)


def _find_value(obj, key: str, kinds: tuple[type, ...]):
    """First value of one of `kinds` stored under exactly `key` anywhere in a JSON document."""
    if isinstance(obj, dict):
        v = obj.get(key)
        if isinstance(v, kinds) and not isinstance(v, bool):
            return v
        obj = list(obj.values())
    if isinstance(obj, list):
        for v in obj:
            r = _find_value(v, key, kinds)
            if r is not None:
                return r
    return None


def _find_number(obj, key: str):
    v = _find_value(obj, key, (int, float))
    return None if v is None else float(v)


def server_cache_info(models_doc, metric_samples: dict[str, float]) -> dict:
    """Cache bytes per token, state bytes per sequence and the weights' dtype as the server
    advertises them in /v1/models metadata or /metrics (None when it does not)."""
    out = {"dtype": _find_value(models_doc, "dtype", (str,))}
    for key in ("cache_bytes_per_token", "state_bytes_per_sequence"):
        v = _find_number(models_doc, key)
        if v is None:
            v = next((val for k, val in metric_samples.items() if k.split("{", 1)[0].endswith(key)), None)
        out[key] = v
    return out


def live_telemetry(cfg: BenchConfig, base_url: str) -> Telemetry | None:
    """Sample the server's process and scrape its metrics while the point runs."""
    if not cfg.telemetry:
        return None
    return Telemetry(base_url, cfg.server_pid or find_local_server_pid(base_url), cfg.scrape_interval_s,
                     cfg.sample_interval_s)


@dataclass
class Harness:
    """How a load point reaches its target. The default speaks HTTP to a real server, samples it
    live and runs on a real-time event loop; a simulation (``flashlane simulate``) gives an
    in-memory transport, its own step records as telemetry and a virtual-time loop, and the
    workload, records, summary and reports stay the bench's own."""
    make_client: Callable[[], httpx.AsyncClient] = make_client
    make_telemetry: Callable[[BenchConfig, str], Telemetry | None] = live_telemetry
    run: Callable[[Coroutine], Any] = asyncio.run
    manifest: dict | None = None    # added to manifest.json (a simulation's assumptions)


@dataclass
class PointOutcome:
    records: list = field(default_factory=list)
    sessions: list = field(default_factory=list)
    window: tuple[float, float] | None = None
    telemetry: Telemetry | None = None
    model: str | None = None
    models_doc: dict | None = None
    target: Target | None = None
    start_utc: str = ""
    cancelled: bool = False
    abort_reason: str | None = None
    t_begin: float = 0.0
    next_index: int = 0


async def _run_point_async(cfg: BenchConfig, source: WorkloadSource, synth: TextSynth,
                           point: LoadPoint, control: RunControl, out: PointOutcome, harness: Harness) -> None:
    out.start_utc = utc_now()
    out.t_begin = now()
    async with harness.make_client() as client:
        base = cfg.base_url.rstrip("/").removesuffix("/v1")
        out.models_doc = await fetch_json(client, base + "/v1/models")
        model = cfg.model
        if model is None:
            ids = [m.get("id") for m in (out.models_doc or {}).get("data", []) if m.get("id")]
            if not ids:
                why = "could not be read (is the server up?)" if out.models_doc is None else "lists no model"
                raise ValueError(f"model: not given and {base}/v1/models {why}")
            model = ids[0]
        out.model = model
        target = Target(base, model, cfg.endpoint or source.default_endpoint, cfg.temperature,
                        cfg.request_timeout_s)
        out.target = target
        tel = harness.make_telemetry(cfg, base)
        if tel is not None:
            tel.start()
        out.telemetry = tel
        ctx = ReplayContext(client=client, target=target, synth=synth, mode=cfg.mode,
                            think_cap_s=cfg.think_cap_s, think_scale=cfg.think_scale, seed=cfg.seed,
                            nonce_salt=point.label)
        out.records, out.sessions = ctx.records, ctx.sessions
        total = control.num_sessions if not control.duration_s else None
        view = ProgressView(point.label, total, enabled=cfg.progress)
        ctx.on_event = view.on_event
        try:
            with view:
                res = await run_load(ctx, source, point, control)
            out.window = (res.window_start, res.window_end)
            out.next_index = res.next_index
        finally:
            if tel is not None:
                await tel.stop()


def analyse_telemetry(tel: Telemetry | None, records, ws: float, we: float, cfg: BenchConfig):
    """(telemetry summary, idle gaps, plot series)."""
    if tel is None:
        return {"enabled": False}, [], None
    intervals = [(r.send_time, r.end_time) for r in records if r.send_time is not None and r.end_time]
    out: dict = {"enabled": True, "utilisation_source": tel.utilisation_series,
                 "scrape_errors": tel.scrape_errors, **tel.hardware()}
    _, cpu = tel.series("server.cpu_percent")
    if cpu:
        out["server_cpu_percent"] = {"mean": sum(cpu) / len(cpu), "max": max(cpu)}
        out["server_rss_max_bytes"] = max(tel.series("server.rss_bytes")[1] or [0])
    _, ccpu = tel.series("client.cpu_percent")
    if ccpu:
        out["client_cpu_percent"] = {"mean": sum(ccpu) / len(ccpu), "max": max(ccpu)}
    metric_stats: dict[str, dict] = {}
    for t, s, n, v in tel.samples:
        if s == "metrics" and "_bucket" not in n and ws <= t <= we + cfg.scrape_interval_s:
            m = metric_stats.setdefault(n, {"n": 0, "sum": 0.0, "max": v, "min": v, "last": v})
            m["n"] += 1
            m["sum"] += v
            m["max"], m["min"], m["last"] = max(m["max"], v), min(m["min"], v), v
    out["server_metrics"] = {k: {"mean": m["sum"] / m["n"], "min": m["min"], "max": m["max"],
                                 "last": m["last"]} for k, m in sorted(metric_stats.items())[:400]}
    gpus = {}
    for i in range(len(tel.nvml.handles) if tel.nvml else 0):
        ts, pw = tel.series(f"gpu{i}.power_w")
        te, en = tel.series(f"gpu{i}.energy_j")
        _, ut = tel.series(f"gpu{i}.util")
        gpus[f"gpu{i}"] = {"util_mean": sum(ut) / len(ut) if ut else None,
                           "power_w_mean": sum(pw) / len(pw) if pw else None,
                           "energy_j": (en[-1] - en[0]) if len(en) > 1 else None}
    if gpus:
        out["gpus_summary"] = gpus
    waiting = tel.metric_matching("num_requests_waiting")
    gaps: list = []
    series = {"waiting": waiting, "intervals": intervals}
    if tel.engine_steps is not None:   # a flashlane server: the engine's own clock
        steps = [(r["start"], r["end"], r["num_waiting"]) for r in tel.engine_steps]
        gaps = step_gaps(steps, intervals, ws, we, cfg.min_gap_s)
        out["utilisation_source"] = "engine.steps"
        out["idle_gap_source"] = "engine step records (/debug/steps)"
        out["engine_steps_complete"] = tel.engine_steps_complete
        out["idle_gaps"] = summarize_gaps(gaps, we - ws)
        out["min_gap_s"] = cfg.min_gap_s
        bf = step_busy_fractions(steps, intervals, ws, we)
        out["busy_overall"], out["busy_when_in_flight"] = bf["overall"], bf["when_in_flight"]
        series.update(util=step_series([s for s in steps if s[1] > ws and s[0] < we]))
    elif tel.utilisation_series:
        out["idle_gap_source"] = f"utilisation samples ({tel.utilisation_series} below {cfg.idle_threshold:g})"
        ut, uv = tel.series(tel.utilisation_series)
        keep = [i for i, t in enumerate(ut) if ws <= t <= we]
        ut, uv = [ut[i] for i in keep], [uv[i] for i in keep]
        raw = detect_gaps(ut, uv, cfg.idle_threshold, cfg.min_gap_s)
        gaps = classify_gaps(raw, intervals, list(zip(*waiting)) if waiting[0] else [],
                             waiting_tolerance_s=cfg.scrape_interval_s / 2)
        out["idle_gaps"] = summarize_gaps(gaps, we - ws)
        out["idle_threshold"] = cfg.idle_threshold
        out["min_gap_s"] = cfg.min_gap_s
        bf = busy_fractions(ut, uv, intervals)
        out["busy_overall"], out["busy_when_in_flight"] = bf["overall"], bf["when_in_flight"]
        series.update(util=(ut, uv))
    return out, gaps, series


def run_point(cfg: BenchConfig, source: WorkloadSource, synth: TextSynth, point: LoadPoint,
              run_dir: Path, harness: Harness | None = None) -> dict:
    """Run one load point and write its folder; returns the summary."""
    harness = harness or Harness()
    control = cfg.control(point)
    out = PointOutcome()
    interrupted = None
    try:
        harness.run(_run_point_async(cfg, source, synth, point, control, out, harness))
    except KeyboardInterrupt as e:
        out.cancelled, interrupted = True, e
    except BenchAbort as e:
        out.abort_reason, interrupted = str(e), e
    if out.window is None:
        prof = [r.end_time for r in out.records if r.phase == PHASE_PROFILING and r.end_time]
        out.window = (min([r.send_time for r in out.records if r.send_time] or [out.t_begin]),
                      max(prof or [out.t_begin]))
    summary = write_point(cfg, source, synth, point, control, out, run_dir, harness.manifest)
    if interrupted is not None:
        raise interrupted
    return summary


def write_point(cfg, source, synth, point, control, out: PointOutcome, run_dir: Path,
                extra_manifest: dict | None = None) -> dict:
    run_dir.mkdir(parents=True, exist_ok=True)
    ws, we = out.window
    page_size, page_size_source = resolve_page_size(cfg.page_size, out.models_doc)
    params = SummaryParams(concurrency=point.concurrency, request_rate=point.request_rate,
                           mode=cfg.mode, slo=cfg.slo, max_error_rate=cfg.max_error_rate,
                           cancelled=out.cancelled, abort_reason=out.abort_reason,
                           n_boot=cfg.n_boot, seed=cfg.seed, page_size=page_size)
    summary = compute_summary(out.records, out.sessions, ws, we, params)
    tel_summary, gaps, series = analyse_telemetry(out.telemetry, out.records, ws, we, cfg)
    summary["telemetry"] = tel_summary
    last = {}
    if out.telemetry and out.telemetry.last_scrape:
        from .telemetry import parse_prometheus
        last = parse_prometheus(out.telemetry.last_scrape)
    summary["server_info"] = {
        "models": [m.get("id") for m in (out.models_doc or {}).get("data", [])],
        **server_cache_info(out.models_doc, last)}
    cc = tel_summary.get("client_cpu_percent")
    if cc and cc["mean"] > 85.0:
        summary["validity"]["valid"] = False
        summary["validity"]["reasons"].append(
            f"bench client CPU saturated ({cc['mean']:.0f}% of a core on average)")

    gpus = out.telemetry.hardware()["gpus"] if out.telemetry else []
    manifest = {
        "harness": "flashlane-bench", "harness_version": harness_version(), "git_sha": git_sha(),
        "argv": cfg.argv, "server_command": cfg.server_command, "base_url": cfg.base_url,
        "model": out.model, "server_models": out.models_doc, "endpoint": out.target.endpoint if out.target else None,
        "mode": cfg.mode, "tokenizer": cfg.tokenizer or "approximation (one word ~ one token)",
        "tokenizer_exact": synth.exact, "hardware": host_info(gpus), "workload": source.spec,
        "workload_content_hash": source.content_hash, "seed": cfg.seed,
        "load_point": asdict(point), "run_control": asdict(control),
        "think_cap_s": cfg.think_cap_s, "think_scale": cfg.think_scale, "slo": cfg.slo,
        "max_error_rate": cfg.max_error_rate, "n_boot": cfg.n_boot,
        "page_size": page_size, "page_size_source": page_size_source,
        "window_start": ws, "window_end": we,
        "kv_offload": None, "spec_decode": None, "start_utc": out.start_utc, "end_utc": utc_now(),
        "cancelled": out.cancelled, "abort_reason": out.abort_reason, "clock": "time.perf_counter (monotonic), seconds",
        **(extra_manifest or {}),
    }
    (run_dir / "manifest.json").write_text(json.dumps(manifest, indent=2, default=str))
    write_jsonl(run_dir / "requests.jsonl", out.records)
    write_jsonl(run_dir / "sessions.jsonl", out.sessions)
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    (run_dir / "summary_vllm.json").write_text(json.dumps(to_vllm_flat(summary), indent=2))
    (run_dir / "summary_inferencex.json").write_text(
        json.dumps(to_inferencex(summary, max(1, len(gpus))), indent=2))
    if out.telemetry:
        tdir = run_dir / "telemetry"
        out.telemetry.write(tdir, ws)
        (tdir / "idle_gaps.json").write_text(json.dumps(gaps, indent=2))
        (tdir / "summary.json").write_text(json.dumps(tel_summary, indent=2))

    figs = {"Latency CDFs": plots.latency_cdfs({point.label: cdf_series(out.records, out.sessions)})}
    if series is not None:
        times, counts = in_flight_series(series["intervals"])
        ut, uv = series.get("util", ([], []))
        figs["Utilisation timeline"] = plots.utilisation_timeline(
            ut, uv, times, counts, gaps, ws, series["waiting"],
            util_label=tel_summary.get("utilisation_source") or "utilisation")
    (run_dir / "report.md").write_text(report_md.render_run(summary, manifest))
    (run_dir / "report.html").write_text(report_html.render_run(summary, manifest, figs))
    summary["_manifest"] = manifest  # in-memory only (sweep / compare reports)
    summary["_next_session_index"] = out.next_index  # in-memory only (interleaved rounds)
    return summary


def cdf_series(records, sessions) -> dict[str, list[float]]:
    ok = [r for r in records if r.phase == PHASE_PROFILING and r.ok]
    return {"TTFT (s)": [ttft(r) for r in ok], "TPOT (s)": [tpot(r) for r in ok],
            "E2E (s)": [e2e(r) for r in ok],
            "task latency (s)": [s.latency_s for s in sessions
                                 if s.phase == PHASE_PROFILING and s.completed and not s.truncated]}


def sweep_points(points: list[tuple[LoadPoint, dict]]) -> list[dict]:
    return [{"x": p.concurrency if p.concurrency is not None else p.request_rate,
             "tasks_per_hour": s["tasks_per_hour"], "task_p90_s": s["task_latency_s"]["p90"],
             "output_tok_s": s["throughput"]["output_tok_s"]} for p, s in points]


def run_bench(cfg: BenchConfig, out_dir: Path | None = None,
              resolve_tokenizer: TokenizerResolver | None = None,
              harness_for: Callable[[LoadPoint], Harness] | None = None) -> list[tuple[LoadPoint, dict, Path]]:
    """Every load point of `cfg`; returns [(point, summary, run folder)]. `resolve_tokenizer`
    maps a `cfg.tokenizer` that is not a path (e.g. a preset name) to one; see `load_tokenizer`.
    `harness_for` gives each point its harness (a simulation: a fresh simulated server each)."""
    out_dir = Path(out_dir or cfg.output_dir)
    source = build_source(cfg)
    synth = TextSynth(seed=cfg.seed, tokenizer=load_tokenizer(cfg.tokenizer, resolve_tokenizer))
    points = cfg.load_points()
    results = []
    for p in points:
        run_dir = out_dir if len(points) == 1 else out_dir / p.label
        results.append((p, run_point(cfg, source, synth, p, run_dir, harness_for(p) if harness_for else None),
                        run_dir))
    if len(points) > 1:
        write_sweep(out_dir, results)
    return results


def write_sweep(out_dir: Path, results) -> None:
    manifest = results[0][1]["_manifest"]
    labelled = [(p.label, s) for p, s, _ in results]
    figs = {"Throughput and task latency vs load": plots.sweep({manifest["model"]: sweep_points(
        [(p, s) for p, s, _ in results])})}
    cdfs = {}
    for p, s, d in results:
        from .records import read_requests, read_sessions
        cdfs[p.label] = cdf_series(read_requests(d / "requests.jsonl"), read_sessions(d / "sessions.jsonl"))
    figs["Latency CDFs"] = plots.latency_cdfs(cdfs)
    (out_dir / "report.md").write_text(report_md.render_sweep(labelled, manifest))
    (out_dir / "report.html").write_text(report_html.render_sweep(labelled, manifest, figs))
    (out_dir / "sweep_summary.json").write_text(json.dumps(
        {"schema_version": results[0][1]["schema_version"], "model": manifest["model"],
         "points": [{"label": p.label, "folder": d.name, **sweep_points([(p, s)])[0],
                     "valid": s["validity"]["valid"]} for p, s, d in results]}, indent=2))
