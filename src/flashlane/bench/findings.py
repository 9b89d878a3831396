"""What a multi-stack comparison found, as data: per stack and load point the hybrid/standard
per-task latency ratio with its bootstrap CI and verdict, flips of the verdict between load
points, and the waterfall from one stack to the next. Pure functions of per-task latencies and
summaries; `explain` turns them into sentences and `compare` into tables and plots."""

from __future__ import annotations

from dataclasses import dataclass, field

from .stats import paired_ratio_ci, ratio_of_means_ci

SLOWER, FASTER, SAME, TOO_FEW = "slower", "faster", "no significant difference", "too few tasks"


@dataclass
class PointFinding:
    stack: str
    load: float
    hybrid_latencies: list[float]
    standard_latencies: list[float]
    ci: dict | None = None
    verdict: str = TOO_FEW
    noisy: list[str] = field(default_factory=list)  # reasons the timings may be distorted
    # paired rounds (interleaved runs): per-round means (hybrid, standard) of each measure
    pairs: list[tuple[float, float]] = field(default_factory=list)
    engine: dict | None = None   # the same ratio on the engine's busy time per task: {ci, verdict}
    cpu: dict | None = None      # ... and on the server process tree's CPU seconds per task (HTTP + engine)

    @property
    def ratio(self) -> float | None:
        if self.ci:
            return self.ci["ratio"]
        if self.hybrid_latencies and self.standard_latencies:
            b = sum(self.standard_latencies) / len(self.standard_latencies)
            return (sum(self.hybrid_latencies) / len(self.hybrid_latencies)) / b if b > 0 else None
        return None

    def mean(self, role: str) -> float | None:
        v = self.hybrid_latencies if role == "hybrid" else self.standard_latencies
        return sum(v) / len(v) if v else None


def verdict_of(ci: dict | None) -> str:
    """Direction of hybrid/standard per-task latency: slower (CI above 1), faster (below 1)."""
    if ci is None:
        return TOO_FEW
    if not ci["significant"]:
        return SAME
    return SLOWER if ci["low"] > 1.0 else FASTER


def point_finding(stack: str, load: float, hybrid: list[float], standard: list[float],
                  n_boot: int = 2000, seed: int = 0, noisy: list[str] | None = None) -> PointFinding:
    ci = ratio_of_means_ci([[x] for x in hybrid], [[x] for x in standard], n_boot=n_boot, seed=seed)
    return PointFinding(stack, load, list(hybrid), list(standard), ci, verdict_of(ci), list(noisy or []))


def paired_finding(stack: str, load: float, hybrid: list[float], standard: list[float],
                   pairs: list[tuple[float, float]], engine_pairs: list[tuple[float, float]] | None = None,
                   cpu_pairs: list[tuple[float, float]] | None = None,
                   noisy: list[str] | None = None) -> PointFinding:
    """A finding from interleaved rounds: the ratio and its CI from the paired per-round means
    (the same tasks on both sides, back to back), and the same on engine time and CPU time."""
    ci = paired_ratio_ci([h for h, _ in pairs], [s for _, s in pairs])
    f = PointFinding(stack, load, list(hybrid), list(standard), ci, verdict_of(ci), list(noisy or []),
                     list(pairs))
    for name, ps in (("engine", engine_pairs), ("cpu", cpu_pairs)):
        if ps and len(ps) == len(pairs):
            c = paired_ratio_ci([h for h, _ in ps], [s for _, s in ps])
            setattr(f, name, {"ci": c, "verdict": verdict_of(c), "hybrid": sum(h for h, _ in ps) / len(ps),
                              "standard": sum(s for _, s in ps) / len(ps)})
    return f


def disagreement(f: PointFinding) -> str | None:
    """How the engine-time / CPU-time verdicts differ from the wall-clock one, or None."""
    out = [f"{label} says {m['verdict']} ({m['ci']['ratio']:.2f}×)" for label, m in
           (("engine busy time", f.engine), ("server CPU time", f.cpu))
           if m and m["ci"] and m["verdict"] != f.verdict]
    return "; ".join(out) or None


def flips(points: list[PointFinding]) -> list[tuple[PointFinding, PointFinding]]:
    """Consecutive load points (same stack) whose ratio sits on opposite sides of 1."""
    out = []
    ordered = sorted(points, key=lambda p: p.load)
    for prev, cur in zip(ordered, ordered[1:]):
        if prev.ratio is None or cur.ratio is None:
            continue
        if (prev.ratio - 1.0) * (cur.ratio - 1.0) < 0:
            out.append((prev, cur))
    return out


def waterfall(stacks: list[tuple[str, PointFinding]]) -> list[dict]:
    """One step per stack, in the order run (naive -> hybrid-cache-gap -> flashlane): mean task
    latency of each model, the ratio, and the change from the previous stack."""
    steps, prev = [], None
    for name, f in stacks:
        h, s, r = f.mean("hybrid"), f.mean("standard"), f.ratio
        step = {"stack": name, "load": f.load, "hybrid_s": h, "standard_s": s, "ratio": r,
                "ratio_low": f.ci["low"] if f.ci else None, "ratio_high": f.ci["high"] if f.ci else None,
                "d_hybrid_s": None, "d_standard_s": None, "d_ratio": None}
        if prev is not None:
            for key, cur, old in (("d_hybrid_s", h, prev["hybrid_s"]), ("d_standard_s", s, prev["standard_s"]),
                                  ("d_ratio", r, prev["ratio"])):
                step[key] = cur - old if cur is not None and old is not None else None
        steps.append(step)
        prev = step
    return steps


def reproducing_stacks(findings: list[PointFinding]) -> list[PointFinding]:
    """Points where the hybrid is significantly slower per task: the public finding's direction."""
    return [f for f in findings if f.verdict == SLOWER]
