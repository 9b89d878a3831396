"""The named metrics of one measured load point (a bench summary), with their direction and
confidence interval: one table that tune's objectives and SLOs and history's trends all read."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable


@dataclass(frozen=True)
class Metric:
    name: str
    unit: str
    higher_is_better: bool
    value: Callable[[dict], float | None]
    ci: Callable[[dict], tuple[float, float] | None] = lambda s: None
    help: str = ""


def _get(summary: dict, *path):
    v = summary
    for k in path:
        if not isinstance(v, dict):
            return None
        v = v.get(k)
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None


def _ci(key: str):
    def read(summary: dict):
        c = (summary.get("confidence_intervals") or {}).get(key)
        return (float(c["low"]), float(c["high"])) if c else None
    return read


def _tasks_per_hour_ci(summary: dict):
    """Closed loop: tasks/hour is concurrency / mean task latency (Little's law), so its relative
    uncertainty is the mean latency's; the cluster-bootstrap CI of that mean is scaled over."""
    if not (summary.get("load_point") or {}).get("concurrency"):
        return None
    mean, ci, tph = _get(summary, "task_latency_s", "mean"), _ci("task_latency_mean")(summary), \
        _get(summary, "tasks_per_hour")
    if not mean or not ci or tph is None or ci[0] <= 0:
        return None
    return tph * mean / ci[1], tph * mean / ci[0]


METRICS: dict[str, Metric] = {m.name: m for m in (
    Metric("tasks_per_hour", "tasks/h", True, lambda s: _get(s, "tasks_per_hour"), _tasks_per_hour_ci,
           "agentic sessions started and finished in the window, per hour"),
    Metric("goodput", "req/s", True, lambda s: _get(s, "goodput", "requests_per_s"),
           help="requests meeting every goodput SLO, per second (needs --goodput-slo / --slo of bench)"),
    Metric("output_tok_s", "tok/s", True, lambda s: _get(s, "throughput", "output_tok_s")),
    Metric("total_tok_s", "tok/s", True, lambda s: _get(s, "throughput", "total_tok_s")),
    Metric("p90_task_latency", "s", False, lambda s: _get(s, "task_latency_s", "p90"), _ci("task_latency_p90")),
    Metric("mean_task_latency", "s", False, lambda s: _get(s, "task_latency_s", "mean"),
           _ci("task_latency_mean")),
    Metric("ttft_mean", "s", False, lambda s: _get(s, "ttft_s", "mean"), _ci("ttft_mean")),
    Metric("ttft_p90", "s", False, lambda s: _get(s, "ttft_s", "p90")),
    Metric("ttft_p99", "s", False, lambda s: _get(s, "ttft_s", "p99")),
    Metric("tpot_mean", "s", False, lambda s: _get(s, "tpot_s", "mean"), _ci("tpot_mean")),
    Metric("tpot_p90", "s", False, lambda s: _get(s, "tpot_s", "p90")),
    Metric("e2e_p90", "s", False, lambda s: _get(s, "e2e_s", "p90")),
    Metric("error_rate", "", False, lambda s: _get(s, "errors", "rate")),
)}


def metric(name: str) -> Metric:
    m = METRICS.get(name)
    if m is None:
        raise ValueError(f"metric: unknown {name!r}; choose from {', '.join(METRICS)}")
    return m


def extract(summary: dict) -> dict[str, tuple[float | None, float | None, float | None]]:
    """{metric: (value, ci_low, ci_high)} for every metric the summary has a value for."""
    out = {}
    for m in METRICS.values():
        v = m.value(summary)
        if v is None:
            continue
        ci = m.ci(summary)
        out[m.name] = (v, ci[0], ci[1]) if ci else (v, None, None)
    return out
