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


def sweep(points: dict[str, list[dict]], x_label: str = "concurrency (sessions in flight) or rate") -> bytes:
    """points: {target: [{x, tasks_per_hour, task_p90_s, output_tok_s}]} -> 3 panels vs load."""
    fig, axes = plt.subplots(1, 3, figsize=(15, 3.8))
    for target, pts in points.items():
        pts = sorted(pts, key=lambda p: p["x"])
        xs = [p["x"] for p in pts]
        for ax, key in zip(axes, ("tasks_per_hour", "task_p90_s", "output_tok_s")):
            ax.plot(xs, [p.get(key) if p.get(key) is not None else np.nan for p in pts], "o-", label=target)
    for ax, title in zip(axes, ("tasks / hour", "p90 task latency (s)", "output tokens / s")):
        ax.set_title(title)
        ax.set_xlabel(x_label)
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
    return _png(fig)


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


def ratio_waterfall(steps: list[dict], hybrid: str, standard: str) -> bytes:
    """Left: mean task latency of each model per stack. Right: the hybrid/standard per-task
    latency ratio as a waterfall, each stack's change floating from the previous level, with the
    stack's 95% CI as a whisker; the dashed line is parity (1x)."""
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 4))
    names = [s["stack"] for s in steps]
    x = np.arange(len(steps))
    for off, key, label, colour in ((-0.2, "hybrid_s", hybrid, "#3182bd"), (0.2, "standard_s", standard, "#e6550d")):
        vals = [s[key] if s[key] is not None else np.nan for s in steps]
        ax1.bar(x + off, vals, width=0.4, label=label, color=colour)
    ax1.set_xticks(x, names)
    ax1.set_xlabel("serving stack")
    ax1.set_ylabel("mean task latency (s)")
    ax1.set_ylim(bottom=0)
    ax1.legend(fontsize=8)
    ax1.grid(axis="y", alpha=0.3)
    prev = 0.0
    for i, s in enumerate(steps):
        r = s["ratio"]
        if r is None:
            continue
        lo, hi = sorted((prev, r))
        colour = "#636363" if i == 0 else ("#31a354" if r < prev else "#de2d26")
        ax2.bar(i, hi - lo, bottom=lo, width=0.6, color=colour)
        if s["ratio_low"] is not None:
            ax2.errorbar(i, r, yerr=[[r - s["ratio_low"]], [s["ratio_high"] - r]], color="black", capsize=4)
        ax2.annotate(f"{r:.2f}×" + (f" ({s['d_ratio']:+.2f})" if s["d_ratio"] is not None else ""),
                     (i, max(hi, s["ratio_high"] or hi)), textcoords="offset points", xytext=(0, 5),
                     ha="center", fontsize=8)
        prev = r
    ax2.axhline(1.0, ls="--", color="#777", lw=1)
    ax2.set_xticks(x, names)
    ax2.set_xlabel("serving stack (each bar: the change from the previous stack)")
    ax2.set_ylabel(f"{hybrid} / {standard} per-task latency")
    ax2.set_ylim(bottom=0)
    ax2.grid(axis="y", alpha=0.3)
    fig.suptitle("Per-task latency by serving stack")
    return _png(fig)
