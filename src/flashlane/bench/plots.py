"""Report plots (matplotlib, Agg backend), returned as PNG bytes."""

from __future__ import annotations

import io

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

GAP_COLOURS = {"A": "#9ecae1", "B": "#fc9272", "C": "#fdd0a2"}


def _png(fig) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=90, bbox_inches="tight")
    plt.close(fig)
    return buf.getvalue()


def latency_cdfs(series: dict[str, dict[str, list[float]]]) -> bytes:
    """series: {run label: {metric label: values}} -> one CDF panel per metric."""
    metrics = []
    for per_run in series.values():
        for m in per_run:
            if m not in metrics:
                metrics.append(m)
    n = max(1, len(metrics))
    cols = min(2, n)
    rows = -(-n // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(6 * cols, 3.6 * rows), squeeze=False)
    for ax, m in zip(axes.flat, metrics):
        for label, per_run in series.items():
            v = np.sort(np.asarray([x for x in per_run.get(m, []) if x is not None], dtype=float))
            if v.size:
                ax.step(v, np.arange(1, v.size + 1) / v.size, where="post", label=f"{label} (n={v.size})")
        ax.set_xlabel(m)
        ax.set_ylabel("fraction of requests / tasks ≤ x")
        ax.set_ylim(0, 1.02)
        ax.set_xlim(left=0)
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7)
    for ax in list(axes.flat)[len(metrics):]:
        ax.axis("off")
    fig.suptitle("Latency CDFs")
    return _png(fig)


SWEEP_METRICS = (("tasks_per_hour", "tasks / hour", "tasks / hour"),
                 ("task_p90_s", "p90 task latency", "p90 task latency (s)"),
                 ("output_tok_s", "output throughput", "output tokens / s"))


def _value(v) -> float:
    return np.nan if v is None else float(v)


def _num(v: float) -> str:
    if not np.isfinite(v):
        return "n/a"
    return f"{v:,.0f}" if abs(v) >= 100 else f"{v:.3g}"


def sweep(points: dict[str, list[dict]], x_label: str = "concurrency (sessions in flight) or rate") -> bytes:
    """points: {target: [{x, tasks_per_hour, task_p90_s, output_tok_s}]} -> 3 panels vs load."""
    return _png(sweep_figure(points, x_label))


def sweep_figure(points: dict[str, list[dict]], x_label: str = "concurrency (sessions in flight) or rate"):
    """The figure of `sweep`: lines with markers vs load when some series has two or more load
    points; a bar per series (value on top) when each has one, since a line of one point is a
    lone dot on an axis autoscaled to +-4% of its value."""
    series = {t: sorted(pts, key=lambda p: p["x"]) for t, pts in points.items() if pts}
    fig, axes = plt.subplots(1, 3, figsize=(15, 3.8))
    if all(len(pts) == 1 for pts in series.values()):
        _sweep_bars(axes, series, x_label)
    else:
        for target, pts in series.items():
            xs = [p["x"] for p in pts]
            for ax, (key, _, _) in zip(axes, SWEEP_METRICS):
                ax.plot(xs, [_value(p.get(key)) for p in pts], "o-", label=target)
        loads = sorted({p["x"] for pts in series.values() for p in pts})
        for ax in axes:
            ax.set_xlabel(x_label)
            ax.set_ylim(bottom=0)
            if len(loads) <= 10:   # tick the measured loads, not 1.5 sessions
                ax.set_xticks(loads, [f"{v:g}" for v in loads])
            if ax.get_legend_handles_labels()[0]:
                ax.legend(fontsize=8)
    for ax, (_, title, unit) in zip(axes, SWEEP_METRICS):
        ax.set_title(title)
        ax.set_ylabel(unit)
        ax.grid(alpha=0.3, axis="y" if ax.patches else "both")
    fig.tight_layout()
    return fig


def _sweep_bars(axes, series: dict[str, list[dict]], x_label: str) -> None:
    names = list(series)
    loads = [pts[0]["x"] for pts in series.values()]
    same = len(set(loads)) <= 1
    ticks = names if same else [f"{n}\n(x = {x:g})" for n, x in zip(names, loads)]
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for ax, (key, _, _) in zip(axes, SWEEP_METRICS):
        vals = [_value(pts[0].get(key)) for pts in series.values()]
        pos = np.arange(len(names))
        ax.bar(pos, vals, width=0.6, color=[colours[i % len(colours)] for i in range(len(names))])
        top = max([v for v in vals if np.isfinite(v)] + [0.0]) or 1.0
        ax.set_ylim(0, top * 1.18)    # room for the value labels inside the axes
        for i, v in enumerate(vals):
            ax.text(i, (v if np.isfinite(v) else 0.0) + 0.02 * top, _num(v), ha="center", va="bottom", fontsize=8)
        ax.set_xticks(pos, ticks)
        ax.set_xlim(-0.6, len(names) - 0.4)   # a missing (nan) bar still gets its slot
        ax.set_xlabel(f"target, at {x_label} = {loads[0]:g}" if same and loads else "target (load x per bar)")


def utilisation_timeline(times, util, inflight_times, inflight_counts, gaps, t0: float,
                         waiting: tuple[list[float], list[float]] | None = None,
                         util_label: str = "utilisation") -> bytes:
    """Utilisation and in-flight requests over time, idle gaps shaded by class."""
    fig, ax = plt.subplots(figsize=(12, 3.6))
    if len(times):
        ax.plot(np.asarray(times) - t0, util, color="#2171b5", lw=1, label=util_label)
    ax.set_ylim(-0.02, 1.05)
    ax.set_ylabel(util_label)
    ax.set_xlabel("time since profiling start (s)")
    shown = set()
    for g in gaps:
        c = g["cls"]
        ax.axvspan(g["start"] - t0, g["end"] - t0, color=GAP_COLOURS[c], alpha=0.6,
                   label=None if c in shown else f"idle gap {c}")
        shown.add(c)
    ax2 = ax.twinx()
    if len(inflight_times):
        ax2.step(np.asarray(inflight_times) - t0, inflight_counts, where="post", color="#238b45",
                 lw=1, label="in flight")
    if waiting and len(waiting[0]):
        ax2.step(np.asarray(waiting[0]) - t0, waiting[1], where="post", color="#cb181d", lw=1,
                 ls="--", label="waiting (server)")
    ax2.set_ylabel("requests")
    h1, l1 = ax.get_legend_handles_labels()
    h2, l2 = ax2.get_legend_handles_labels()
    ax.legend(h1 + h2, l1 + l2, fontsize=7, loc="upper right")
    ax.set_title("Utilisation timeline (idle gaps: A workload idle, B stack bubble, C queue)")
    return _png(fig)


def ratio_waterfall(steps: list[dict], hybrid: str, standard: str, title: str | None = None) -> bytes:
    """Left: mean task latency of each model per stack. Right: the hybrid/standard per-task
    latency ratio as a waterfall, each stack's change floating from the previous level, with the
    stack's 95% CI as a whisker; the dashed line is parity (1x). ``title`` heads the ratio panel."""
    return _png(ratio_waterfall_figure(steps, hybrid, standard, title))


def ratio_waterfall_figure(steps: list[dict], hybrid: str, standard: str, title: str | None = None):
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 4))
    names = [s["stack"] for s in steps]
    x = np.arange(len(steps))
    for off, key, label, colour in ((-0.2, "hybrid_s", hybrid, "#3182bd"), (0.2, "standard_s", standard, "#e6550d")):
        ax1.bar(x + off, [_value(s.get(key)) for s in steps], width=0.4, label=label, color=colour)
    ax1.set_xticks(x, names)
    ax1.set_xlabel("serving stack")
    ax1.set_ylabel("mean task latency (s)")
    ax1.set_title("mean task latency per model")
    ax1.set_ylim(bottom=0)
    ax1.legend(fontsize=8)
    ax1.grid(axis="y", alpha=0.3)
    bars, prev = [], 0.0
    for i, s in enumerate(steps):
        r = s.get("ratio")
        if r is None:
            continue
        lo, hi = sorted((prev, r))
        ci_lo, ci_hi = s.get("ratio_low"), s.get("ratio_high")
        ci = ci_lo is not None and ci_hi is not None   # a whisker needs both ends
        bars.append((i, r, lo, hi, ci_lo if ci else None, ci_hi if ci else None, s.get("d_ratio"), prev))
        prev = r
    # every label sits above its bar and whisker, under a top with room for one line of text
    top = max([1.0] + [max(hi, ci_hi or hi) for _, _, _, hi, _, ci_hi, _, _ in bars])
    ax2.set_ylim(0, top * 1.2)
    for i, r, lo, hi, ci_lo, ci_hi, d, before in bars:
        colour = "#636363" if i == 0 else ("#31a354" if r < before else "#de2d26")
        ax2.bar(i, hi - lo, bottom=lo, width=0.6, color=colour)
        if ci_lo is not None:
            ax2.errorbar(i, r, yerr=[[max(r - ci_lo, 0.0)], [max(ci_hi - r, 0.0)]], color="black", capsize=4)
        ax2.text(i, max(hi, ci_hi or hi) + 0.02 * top, f"{r:.2f}×" + (f" ({d:+.2f})" if d is not None else ""),
                 ha="center", va="bottom", fontsize=8)
    ax2.axhline(1.0, ls="--", color="#777", lw=1)
    ax2.set_xticks(x, names)
    ax2.set_xlim(-0.6, len(steps) - 0.4)
    ax2.set_xlabel("serving stack (each bar: the change from the previous stack)")
    ax2.set_ylabel(f"{hybrid} / {standard} per-task latency (×)")
    if title:
        ax2.set_title(title)
    ax2.grid(axis="y", alpha=0.3)
    fig.suptitle("Per-task latency by serving stack")
    fig.tight_layout()
    return fig
