"""Did a metric regress from a baseline run to a candidate run, beyond its confidence interval?

Points are matched by (target, load point); a run with a single target matches the other run's
single target by load point alone (same config, another commit or machine). With CIs on both
sides a regression is a candidate interval entirely on the worse side of the baseline's; without
them, a change worse than `tolerance` (relative) counts.
"""

from __future__ import annotations

from dataclasses import dataclass

from .metrics import metric
from .store import Point, ResultsStore


@dataclass
class Verdict:
    key: str
    baseline: tuple[float, float | None, float | None]
    candidate: tuple[float, float | None, float | None]
    change: float  # relative, signed: > 0 = better
    regressed: bool
    basis: str  # "CI" or "tolerance"


def match_points(base: list[Point], cand: list[Point]) -> list[tuple[str, Point, Point]]:
    tb, tc = {p.target for p in base}, {p.target for p in cand}
    if len(tb) == 1 and len(tc) == 1:
        key = lambda p: p.label  # noqa: E731
    else:
        key = lambda p: f"{p.target}/{p.label}"  # noqa: E731
    bm, cm = {key(p): p for p in base}, {key(p): p for p in cand}
    common = [k for k in bm if k in cm]
    if not common:
        raise ValueError(f"no common point: baseline has {sorted(bm)}, candidate has {sorted(cm)}")
    return [(k, bm[k], cm[k]) for k in common]


def judge(name: str, b: tuple, c: tuple, tolerance: float) -> Verdict | None:
    m = metric(name)
    bv, blo, bhi = b
    cv, clo, chi = c
    sign = 1.0 if m.higher_is_better else -1.0
    change = sign * (cv - bv) / abs(bv) if bv else 0.0
    if None not in (blo, bhi, clo, chi):
        regressed = chi < blo if m.higher_is_better else clo > bhi
        basis = "CI"
    else:
        regressed, basis = change < -tolerance, "tolerance"
    return Verdict("", b, c, change, regressed, basis)


def check(store: ResultsStore, baseline: str, candidate: str, name: str,
          tolerance: float = 0.05) -> list[Verdict]:
    metric(name)  # a clear error for an unknown name
    b_id, c_id = store.resolve(baseline), store.resolve(candidate)
    out = []
    for key, pb, pc in match_points(store.points(b_id), store.points(c_id)):
        if name not in pb.metrics or name not in pc.metrics:
            continue
        v = judge(name, pb.metrics[name], pc.metrics[name], tolerance)
        v.key = key
        out.append(v)
    if not out:
        raise ValueError(f"metric {name!r}: not measured in both run {b_id} and run {c_id}")
    return out
