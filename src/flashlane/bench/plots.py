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
        ax.set_ylabel("fraction ≤ x")
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7)
    for ax in list(axes.flat)[len(metrics):]:
        ax.axis("off")
    fig.suptitle("Latency CDFs")
    return _png(fig)


def sweep(points: dict[str, list[dict]]) -> bytes:
    """points: {target: [{x, tasks_per_hour, task_p90_s, output_tok_s}]} -> 3 panels vs load."""
    fig, axes = plt.subplots(1, 3, figsize=(15, 3.8))
    for target, pts in points.items():
        pts = sorted(pts, key=lambda p: p["x"])
        xs = [p["x"] for p in pts]
        for ax, key in zip(axes, ("tasks_per_hour", "task_p90_s", "output_tok_s")):
            ax.plot(xs, [p.get(key) if p.get(key) is not None else np.nan for p in pts], "o-", label=target)
    for ax, title in zip(axes, ("tasks / hour", "p90 task latency (s)", "output tokens / s")):
        ax.set_title(title)
        ax.set_xlabel("concurrency (lanes) or rate")
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
