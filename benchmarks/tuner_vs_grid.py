"""The tuner itself: Bayesian search (`flashlane tune`, TPE and GP) vs a vLLM `auto_tune`-style
grid over max_num_seqs x max_num_batched_tokens, with the same number of trials, on tiny-flash
with the agentic workload and the same SLOs. Every method runs through `flashlane tune` (real
servers, the same seeded sessions every trial); only the sampler and the search space differ.

Per method: the best feasible objective (tasks/hour) after N trials, the best-so-far curve, and
trials-to-within-5%-of-best (of the best any method found). JSON to benchmarks/results/.

    python benchmarks/tuner_vs_grid.py                              # 12 trials each (~1 h on 2 cores)
    python benchmarks/tuner_vs_grid.py --trials 2 --scale small --grid-seqs 4,8 --grid-tokens 512 \\
        --concurrency 1 --num-sessions 1                            # a smoke run
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

from common import write_result

from flashlane.cli.main import main as flashlane


def ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def grid_space(seqs: list[int], tokens: list[int]) -> dict:
    return {"knobs": {"max_num_seqs": {"type": "categorical", "choices": seqs, "default": seqs[-1]},
                      "max_num_batched_tokens": {"type": "categorical", "choices": tokens, "default": tokens[-1]}}}


def best_so_far(trials: list[dict], maximize: bool) -> list[float | None]:
    out, best = [], None
    for t in sorted(trials, key=lambda t: t["number"]):
        if t["feasible"] and t["values"]:
            v = t["values"][0]
            best = v if best is None or (v > best if maximize else v < best) else best
        out.append(best)
    return out


def trials_to_within(curve: list[float | None], target: float, maximize: bool) -> int | None:
    for i, v in enumerate(curve, start=1):
        if v is not None and (v >= target if maximize else v <= target):
            return i
    return None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="tiny-flash")
    ap.add_argument("--samplers", default="tpe,gp", help="Bayesian samplers to run beside the grid")
    ap.add_argument("--bayes-space", choices=("full", "grid-knobs"), default="full",
                    help="full: the built-in flashlane space; grid-knobs: only the grid's two knobs, as ints")
    ap.add_argument("--grid-seqs", type=ints, default=[2, 4, 8, 64])
    ap.add_argument("--grid-tokens", type=ints, default=[256, 1024, 2048])
    ap.add_argument("--trials", type=int, default=None, help="trials per method (default: the grid's size)")
    ap.add_argument("--scale", default="medium")
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--num-sessions", type=int, default=None, help="sessions per trial (default: tune's)")
    ap.add_argument("--slo", action="append", default=None,
                    help="default: p90_task_latency<=20s and ttft_p90<=2s")
    ap.add_argument("--seed", type=int, default=0, help="sampler seed (also orders the grid)")
    ap.add_argument("--work-dir", default=None, help="studies and trial folders (default: a temporary folder)")
    ap.add_argument("--out", default=None, help="default: benchmarks/results/tuner_vs_grid.json")
    a = ap.parse_args()
    n = a.trials or len(a.grid_seqs) * len(a.grid_tokens)
    slos = a.slo or ["p90_task_latency<=20s", "ttft_p90<=2s"]
    work = Path(a.work_dir or tempfile.mkdtemp(prefix="tuner_vs_grid-"))
    work.mkdir(parents=True, exist_ok=True)
    (work / "grid.json").write_text(json.dumps(grid_space(a.grid_seqs, a.grid_tokens)))
    (work / "grid_knobs.json").write_text(json.dumps({"knobs": {
        "max_num_seqs": {"type": "int", "low": min(a.grid_seqs), "high": max(a.grid_seqs), "log": True,
                         "default": a.grid_seqs[-1]},
        "max_num_batched_tokens": {"type": "int", "low": min(a.grid_tokens), "high": max(a.grid_tokens),
                                   "log": True, "default": a.grid_tokens[-1]}}}))
    common = ["tune", "--model", a.model, "--scale", a.scale, "--concurrency", str(a.concurrency),
              "--trials", str(n), "--no-default-trial", "--remeasure-top", "0", "--no-progress", "--no-record",
              "--sampler-seed", str(a.seed), "--storage", f"sqlite:///{work / 'studies.db'}"]
    if a.num_sessions:
        common += ["--num-sessions", str(a.num_sessions)]
    for s in slos:
        common += ["--slo", s]
    methods = {"grid": ["--sampler", "grid", "--search-space", str(work / "grid.json")]}
    for s in [x.strip() for x in a.samplers.split(",") if x.strip()]:
        methods[s] = ["--sampler", s] + ([] if a.bayes_space == "full" else
                                          ["--search-space", str(work / "grid_knobs.json")])
    results = {}
    for name, extra in methods.items():
        out = work / name
        code = flashlane(common + extra + ["--study-name", f"{name}-seed{a.seed}", "--output-dir", str(out)])
        if code != 0:
            sys.exit(f"{name}: flashlane tune exited with {code}")
        results[name] = json.loads((out / "tune.json").read_text())
    maximize = next(iter(results.values()))["directions"][0] == "maximize"
    curves = {k: best_so_far(r["trials"], maximize) for k, r in results.items()}
    finals = [c[-1] for c in curves.values() if c and c[-1] is not None]
    overall = (max(finals) if maximize else min(finals)) if finals else None
    target = None if overall is None else overall * (0.95 if maximize else 1.05)
    report = {"model": a.model, "workload": f"agentic/{a.scale}", "concurrency": a.concurrency, "trials": n,
              "slos": slos, "objective": next(iter(results.values()))["objective"], "seed": a.seed,
              "grid": {"max_num_seqs": a.grid_seqs, "max_num_batched_tokens": a.grid_tokens},
              "bayes_space": a.bayes_space, "best_overall": overall, "methods": {}}
    for k, r in results.items():
        report["methods"][k] = {
            "best_feasible": curves[k][-1] if curves[k] else None,
            "best_config": (r["best"] or {}).get("command"),
            "trials_to_within_5pct_of_best": trials_to_within(curves[k], target, maximize) if target else None,
            "best_so_far": curves[k], "failed_trials": r["n_failed"]}
    write_result("tuner_vs_grid", report, a.out)


if __name__ == "__main__":
    main()
