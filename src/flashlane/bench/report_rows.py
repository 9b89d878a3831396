"""The rows every report shows, as (label, text) pairs, shared by Markdown, HTML and compare."""

from __future__ import annotations


def fmt(v, unit: str = "", digits: int = 3) -> str:
    if v is None:
        return "–"
    if isinstance(v, float):
        if abs(v) >= 1000:
            s = f"{v:,.0f}"
        elif abs(v) >= 100:
            s = f"{v:.1f}"
        else:
            s = f"{v:.{digits}g}"
    else:
        s = str(v)
    return f"{s} {unit}".strip()


def ms(v) -> str:
    return fmt(v * 1000.0 if v is not None else None, "ms")


def block_text(b: dict, keys=("mean", "p50", "p90", "p99"), scale_ms: bool = True) -> str:
    if not b or not b.get("n"):
        return "–"
    f = ms if scale_ms else fmt
    return " / ".join(f"{k} {f(b.get(k))}" for k in keys) + f" (n={b['n']})"


def ci_text(ci: dict | None, scale: float = 1.0, unit: str = "s") -> str:
    if not ci:
        return ""
    return f" [{int(ci['level'] * 100)}% CI {fmt(ci['low'] * scale)}–{fmt(ci['high'] * scale)} {unit}]"


def load_label(lp: dict) -> str:
    if lp.get("concurrency") is not None:
        return f"concurrency {lp['concurrency']}"
    return f"request rate {lp.get('request_rate')}/s"


def prefix_hit_text(cache: dict) -> str:
    """Server-reported vs theoretical token hit rate, and how much of the possible reuse happened."""
    vs = cache.get("prefix_cache_hit_vs_theoretical")
    return (f"server-reported {fmt(cache.get('prefix_cache_hit_rate'))}, theoretical "
            f"{fmt(cache.get('prefix_cache_hit_rate_theoretical'))} (page {cache.get('page_size')})"
            + (f", server ÷ theoretical {fmt(vs)}" if vs is not None else ""))


def stopped_early(s: dict) -> str | None:
    """'aborted' / 'cancelled' when the run did not finish (its validity reasons say so), else None."""
    reasons = s.get("validity", {}).get("reasons", [])
    if any(r.startswith("run aborted") for r in reasons):
        return "aborted"
    if any(r.startswith("run cancelled") for r in reasons):
        return "cancelled"
    return None


def errors_text(s: dict) -> str:
    """Failed profiled requests by class. A run that stopped early never says "none": what made it
    stop is an error that the profiled counts do not hold (e.g. a failed warmup request)."""
    counts = ", ".join(f"{k}: {v}" for k, v in s["errors"]["by_class"].items())
    stopped = stopped_early(s)
    if stopped is None:
        return counts or "none"
    if counts:
        return f"{counts} among profiled requests before the run was {stopped} (see valid)"
    return f"– (run {stopped} before any profiled request failed; see valid)"


def run_rows(s: dict) -> list[tuple[str, str]]:
    req, ses = s["requests"], s["sessions"]
    ci = s.get("confidence_intervals", {})
    tp, cache = s["throughput"], s["cache"]
    rows = [
        ("requests", f"{req['completed']} completed, {req['failed']} failed, {req['warmup']} warmup"
                     + (f", {req['incomplete_outputs']} incomplete outputs" if req["incomplete_outputs"] else "")),
        ("errors by class", errors_text(s)),
        ("sessions (tasks)", f"{ses['completed']} completed, {ses['truncated']} truncated (t*), "
                             f"{ses['incomplete']} incomplete"),
        ("window", fmt(s["window_s"], "s")),
        ("tasks / hour", fmt(s["tasks_per_hour"])
         + (f" (Little's law {fmt(s['tasks_per_hour_littles_law'])})" if "tasks_per_hour_littles_law" in s else "")),
        ("task latency", block_text(s["task_latency_s"], scale_ms=False).replace(" (", " s (")
         + ci_text(ci.get("task_latency_p90"), unit="s (p90)")),
        ("task model / think time", f"{fmt(s['task_model_time_s']['mean'], 's')} / "
                                    f"{fmt(s['task_think_time_s']['mean'], 's')} (mean)"),
        ("TTFT", block_text(s["ttft_s"]) + ci_text(ci.get("ttft_mean"), 1000, "ms (mean)")),
        ("TTFT incl. client queue", block_text(s["ttft_queue_s"])),
        ("TPOT", block_text(s["tpot_s"]) + ci_text(ci.get("tpot_mean"), 1000, "ms (mean)")),
        ("ITL (pooled)", block_text(s["itl_s"])),
        ("E2E latency", block_text(s["e2e_s"])),
        ("interactivity (1/p90 TPOT)", fmt(s["interactivity_from_tpot"].get("p90"), "tok/s/user")),
        ("throughput", f"in {fmt(tp['input_tok_s'])} / out {fmt(tp['output_tok_s'])} / "
                       f"total {fmt(tp['total_tok_s'])} tok/s"),
        ("concurrency", f"effective {fmt(s['concurrency']['effective'])}, active "
                        f"{fmt(s['concurrency']['active'])}, max {s['concurrency']['max_in_flight']}"),
        ("prefix-cache hit (tokens)", prefix_hit_text(cache)),
        ("prefix-cache hit (trace blocks)", f"theoretical {fmt(cache['theoretical_hit_rate'])}"),
    ]
    if s["goodput"].get("slo"):
        g = s["goodput"]
        rows.append(("goodput", f"{fmt(g['requests_per_s'])} req/s meeting {g['slo']} "
                                f"({fmt(g['fraction'] * 100)}%)"))
    tel = s.get("telemetry") or {}
    if tel.get("utilisation_source"):
        rows.append(("utilisation", f"{fmt(tel.get('busy_overall'))} overall, "
                                    f"{fmt(tel.get('busy_when_in_flight'))} while requests in flight "
                                    f"({tel['utilisation_source']})"))
        gaps = tel.get("idle_gaps") or {}
        if gaps:
            rows.append(("idle gaps", f"{gaps['count']} gaps, {fmt(gaps['total_s'], 's')}: " + ", ".join(
                f"{c} {v['count']}× {fmt(v['total_s'], 's')}" for c, v in gaps["by_class"].items())))
    if tel.get("server_cpu_percent"):
        rows.append(("server CPU / RSS", f"{fmt(tel['server_cpu_percent'].get('mean'))}% mean, "
                                         f"{fmt((tel.get('server_rss_max_bytes') or 0) / 2**20)} MiB max RSS"))
    if "degeneration" in s:
        d = s["degeneration"]
        rows.append(("degeneration (live)", f"repeated 4-gram ratio mean "
                                            f"{fmt(d['repeated_4gram_ratio']['mean'])}, hit max_tokens "
                                            f"{fmt(d['hit_max_tokens_rate'])}"))
    v = s["validity"]
    rows.append(("valid", "yes" if v["valid"] else "NO: " + "; ".join(v["reasons"])))
    return rows


def sweep_rows(points: list[tuple[str, dict]]) -> tuple[list[str], list[list[str]]]:
    head = ["load", "tasks/h", "task mean s", "task p90 s", "TTFT p50 ms", "TTFT p90 ms",
            "TPOT mean ms", "ITL p90 ms", "out tok/s", "cache hit", "cache hit theor.", "busy", "errors"]
    rows = []
    for label, s in points:
        tel = s.get("telemetry") or {}
        rows.append([label, fmt(s["tasks_per_hour"]), fmt(s["task_latency_s"]["mean"]),
                     fmt(s["task_latency_s"]["p90"]), ms(s["ttft_s"]["p50"])[:-3],
                     ms(s["ttft_s"]["p90"])[:-3], ms(s["tpot_s"]["mean"])[:-3],
                     ms(s["itl_s"]["p90"])[:-3], fmt(s["throughput"]["output_tok_s"]),
                     fmt(s["cache"].get("prefix_cache_hit_rate")),
                     fmt(s["cache"].get("prefix_cache_hit_rate_theoretical")),
                     fmt(tel.get("busy_overall")), str(s["errors"]["total"])])
    return head, rows
