"""What a study optimises: one metric (or several, for a Pareto front) of the bench summary,
subject to SLOs such as `p90_task_latency<=20s`; metric names and directions come from
`flashlane.results.metrics`, so tune, history and the results store agree on them."""

from __future__ import annotations

import re
from dataclasses import dataclass

from flashlane.results.metrics import METRICS, metric

# A violated SLO without a value (e.g. no task finished): clearly infeasible, still finite.
MISSING_VIOLATION = 1e6
_SLO = re.compile(r"^\s*([a-z0-9_]+)\s*(<=|>=)\s*([0-9.eE+-]+)\s*(ms|s)?\s*$")


@dataclass(frozen=True)
class Slo:
    metric: str
    op: str  # "<=" or ">="
    bound: float

    @property
    def text(self) -> str:
        unit = METRICS[self.metric].unit
        return f"{self.metric}{self.op}{self.bound:g}{unit if unit == 's' else ''}"

    def violation(self, value: float | None) -> float:
        """Optuna constraint value: <= 0 when met, else the relative amount by which it is missed."""
        if value is None:
            return MISSING_VIOLATION
        scale = abs(self.bound) or 1.0
        return (value - self.bound) / scale if self.op == "<=" else (self.bound - value) / scale

    def met(self, value: float | None) -> bool:
        return self.violation(value) <= 0


def parse_slo(text: str) -> Slo:
    """'p90_task_latency<=20s', 'ttft_p90<=500ms', 'tasks_per_hour>=100'."""
    m = _SLO.match(text)
    if not m:
        raise ValueError(f"--slo: expected METRIC<=VALUE or METRIC>=VALUE (e.g. p90_task_latency<=20s), "
                         f"got {text!r}")
    name, op, num, unit = m.groups()
    try:
        met = metric(name)
    except ValueError as e:
        raise ValueError(f"--slo {text}: {e}") from None
    try:
        bound = float(num)
    except ValueError:
        raise ValueError(f"--slo: {num!r} is not a number in {text!r}") from None
    if unit and met.unit != "s":
        raise ValueError(f"--slo: {name} is in {met.unit or 'plain numbers'}, not seconds: drop {unit!r}")
    if unit == "ms":
        bound /= 1000.0
    return Slo(name, op, bound)


@dataclass(frozen=True)
class Objective:
    metrics: tuple[str, ...]
    slos: tuple[Slo, ...] = ()

    def __post_init__(self):
        if not self.metrics:
            raise ValueError("objective: needs at least one metric")
        for n in self.metrics:
            try:
                metric(n)
            except ValueError as e:
                raise ValueError(f"--{'pareto' if len(self.metrics) > 1 else 'objective'}: {e}") from None
        if len(set(self.metrics)) != len(self.metrics):
            raise ValueError(f"--pareto: a metric is listed twice in {','.join(self.metrics)}")

    @property
    def pareto(self) -> bool:
        return len(self.metrics) > 1

    @property
    def directions(self) -> list[str]:
        return ["maximize" if METRICS[n].higher_is_better else "minimize" for n in self.metrics]

    def describe(self) -> str:
        goal = " and ".join(f"{d} {n}" for d, n in zip(self.directions, self.metrics))
        return goal + (f" subject to {', '.join(s.text for s in self.slos)}" if self.slos else "")

    def fingerprint(self) -> dict:
        return {"metrics": list(self.metrics), "slos": [s.text for s in self.slos]}
