"""`flashlane compare --simulate --hardware h200x8 glm-5.3-flash glm-5.3`: the whole study in
simulation, for full-size models on GPUs no one here has.

Each stack's mechanisms run each model on a simulated server (the engine's real scheduler and
cache manager; step costs from the hardware profile's stated peaks and efficiencies, TP/EP as
communication costs) on the same seeded agentic workload, and the per-task latency, tasks/hour and
p90 of both models are printed beside the public finding's. Every assumption is listed, and a
sensitivity line says which assumption moves the hybrid/standard ratio most (each one halved and
doubled, at the stack that reproduces the finding).
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

from ..analyze.models import resolve_model
from ..bench.report_md import md_table
from ..bench.report_rows import fmt
from ..bench.runner import BenchConfig
from ..bench.stacks import Stack
from ..bench.stats import keyed_ratio
from ..bench.task_components import measured_sessions
from ..bench.records import read_sessions
from ..simulate.run import simulate_bench
from ..simulate.setup import is_stateful, on_hardware
from .simulate import engine_args_for

# The public finding this project reproduces (design.md): GLM-5.3-Flash vs GLM-5.3 per agentic
# task at concurrency 1.
SEED = {"hybrid": {"task_min": 14.4, "tasks_per_hour": 4.17, "p90_min": 15.1},
        "standard": {"task_min": 6.8, "tasks_per_hour": 8.8, "p90_min": 7.2}}
SENSITIVITY = ("mfu", "mbu", "interconnect_bw", "kernel_launch_s", "host")
SENSITIVITY_FACTORS = (0.5, 2.0)


def _side(folder: Path, summary: dict) -> dict:
    sessions = measured_sessions(read_sessions(folder / "sessions.jsonl"))
    return {"task_s": summary["task_latency_s"]["mean"], "task_p90_s": summary["task_latency_s"]["p90"],
            "tasks_per_hour": summary["tasks_per_hour"], "ttft_s": summary["ttft_s"]["mean"],
            "itl_s": summary["itl_s"]["mean"], "prefix_hit": summary["cache"].get("prefix_cache_hit_rate"),
            "task_s_by_tree": {s.tree_id: s.latency_s for s in sessions}, "folder": str(folder)}


class Study:
    def __init__(self, models: dict[str, str], hardware: str, tp: int | None, ep: int | None, weight_dtype: str,
                 cfg: BenchConfig, out_dir: Path, log=print):
        self.models, self.hardware, self.tp, self.ep, self.weight_dtype = models, hardware, tp, ep, weight_dtype
        self.cfg, self.out_dir, self.log = cfg, Path(out_dir), log

    def run_side(self, stack: Stack, role: str, folder: Path, scale: dict | None = None) -> dict:
        model = self.models[role]
        args = engine_args_for(resolve_model(model).cfg, stack, [])
        setup = on_hardware(model, self.hardware, args, self.tp, self.ep, self.weight_dtype, scale=scale)
        cfg = replace(self.cfg, output_dir=str(folder), model=model)
        point, summary, run_dir = simulate_bench(setup, cfg, folder)[0]
        return {**_side(run_dir, summary), "engine_args": args, "assumptions": setup.assumptions}

    def run(self, stacks: list[Stack]) -> dict:
        rows = {}
        for stack in stacks:
            sides = {}
            for role in ("hybrid", "standard"):
                self.log(f"simulating {stack.name}: {self.models[role]} on {self.hardware}")
                sides[role] = self.run_side(stack, role, self.out_dir / stack.name / self.models[role])
            sides["ratio"] = keyed_ratio(sides["hybrid"]["task_s_by_tree"], sides["standard"]["task_s_by_tree"])
            rows[stack.name] = sides
        base = max(rows, key=lambda n: rows[n]["ratio"] or 0.0)
        sensitivity = self.sensitivity(next(s for s in stacks if s.name == base))
        return {"hardware": self.hardware, "models": self.models, "stacks": rows, "answer": answer(rows, self.models),
                "sensitivity": sensitivity, "seed": SEED,
                "assumptions": rows[base]["hybrid"]["assumptions"]["assumptions"],
                "layout": rows[base]["hybrid"]["assumptions"]["layout"], "weight_dtype": self.weight_dtype,
                "workload": {"scale": self.cfg.scale, "trace": self.cfg.trace, "seed": self.cfg.seed,
                             "concurrency": self.cfg.concurrency, "tasks_per_side": self.cfg.num_sessions},
                "engine_args": {n: {r: rows[n][r]["engine_args"] for r in ("hybrid", "standard")} for n in rows}}

    def sensitivity(self, stack: Stack) -> dict:
        """Each assumption halved and doubled at ``stack`` (one task per side): the ratio's range."""
        cfg = self.cfg
        self.cfg = replace(cfg, num_sessions=1)
        out = []
        try:
            base = {role: self.run_side(stack, role, self.out_dir / "sensitivity" / "base" / role)
                    for role in ("hybrid", "standard")}
            base_ratio = keyed_ratio(base["hybrid"]["task_s_by_tree"], base["standard"]["task_s_by_tree"])
            for name in SENSITIVITY:
                ratios = {}
                for f in SENSITIVITY_FACTORS:
                    folder = self.out_dir / "sensitivity" / f"{name}x{f:g}"
                    sides = {role: self.run_side(stack, role, folder / role, {name: f}) for role in ("hybrid", "standard")}
                    ratios[f"x{f:g}"] = keyed_ratio(sides["hybrid"]["task_s_by_tree"], sides["standard"]["task_s_by_tree"])
                vals = [v for v in ratios.values() if v is not None]
                out.append({"assumption": name, "ratios": ratios,
                            "swing": (max(vals) - min(vals)) if vals else None})
        finally:
            self.cfg = cfg
        return {"stack": stack.name, "base_ratio": base_ratio,
                "assumptions": sorted(out, key=lambda r: -(r["swing"] or 0.0))}


def answer(rows: dict, models: dict) -> str:
    """One line: which stacks reproduce the finding's direction (the hybrid slower per task) in
    simulation, against the seed's ratio."""
    seed = SEED["hybrid"]["task_min"] / SEED["standard"]["task_min"]
    slower = [n for n, r in rows.items() if (r["ratio"] or 0) > 1.0]
    ratios = ", ".join(f"{n} {r['ratio']:.2f}×" for n, r in rows.items() if r["ratio"] is not None)
    if slower:
        return (f"In simulation {models['hybrid']} is slower per task than {models['standard']} under "
                f"{', '.join(slower)} ({ratios}; the public finding: {seed:.2f}×).")
    return (f"In simulation no stack reproduces the public finding's direction: {models['hybrid']} / "
            f"{models['standard']} per task is {ratios} (the public finding: {seed:.2f}×). With the same "
            "tokens per task, serving mechanics alone (prefix cache, batching, host and launch costs as assumed) "
            "do not make the hybrid slower here; what differs in the public runs (tokens per task, kernel "
            "efficiency of the new architecture) is outside these assumptions.")


def report(doc: dict) -> str:
    hyb, std = doc["models"]["hybrid"], doc["models"]["standard"]
    head = ["stack", "per-task latency (min)", "tasks / hour", "p90 task (min)", "TTFT mean (s)", "ITL mean (ms)",
            "prefix-cache hit", f"{hyb} / {std}"]
    rows = [["**public finding** (seed)", f"{SEED['hybrid']['task_min']} / {SEED['standard']['task_min']}",
             f"{SEED['hybrid']['tasks_per_hour']} / {SEED['standard']['tasks_per_hour']}",
             f"{SEED['hybrid']['p90_min']} / {SEED['standard']['p90_min']}", "–", "–", "–",
             f"{SEED['hybrid']['task_min'] / SEED['standard']['task_min']:.2f}×"]]
    for name, r in doc["stacks"].items():
        h, s = r["hybrid"], r["standard"]
        rows.append([f"{name} (simulated)", f"{fmt(h['task_s'] / 60)} / {fmt(s['task_s'] / 60)}",
                     f"{fmt(h['tasks_per_hour'])} / {fmt(s['tasks_per_hour'])}",
                     f"{fmt(h['task_p90_s'] / 60)} / {fmt(s['task_p90_s'] / 60)}",
                     f"{fmt(h['ttft_s'])} / {fmt(s['ttft_s'])}", f"{fmt(1e3 * h['itl_s'])} / {fmt(1e3 * s['itl_s'])}",
                     f"{fmt(h['prefix_hit'])} / {fmt(s['prefix_hit'])}", f"{fmt(r['ratio'])}×"])
    sens = doc["sensitivity"]
    top = sens["assumptions"][0] if sens["assumptions"] else None
    lines = [f"# flashlane compare --simulate — {hyb} vs {std} on {doc['hardware']}", "",
             f"**Answer:** {doc['answer']}", "",
             "Every figure below except the seed's is simulated: the engine's own scheduler and cache manager with "
             "step costs from the hardware profile's stated numbers (assumptions listed below; none was measured "
             "on a GPU here). Values are hybrid / standard.", "", md_table(head, rows), ""]
    if top:
        lines += [f"**Sensitivity** (at {sens['stack']}, one task per side: {fmt(sens['base_ratio'])}× as assumed; "
                  "each assumption x0.5 and x2): "
                  + "; ".join(f"{r['assumption']} {' / '.join(f'{k} {fmt(v)}×' for k, v in r['ratios'].items())}"
                              for r in sens["assumptions"])
                  + f". The ratio moves most with {top['assumption']} (range {fmt(top['swing'])}).", ""]
    w, lay = doc["workload"], doc["layout"]
    lines += ["## Assumptions", "",
              f"- workload: synthetic agentic sessions, scale {w['scale']}" + (f", trace {w['trace']}" if w["trace"] else "")
              + f", seed {w['seed']}, concurrency {w['concurrency']}, {w['tasks_per_side']} tasks per side, recorded "
              "output lengths (the same tokens for both models: verbosity differences are not modelled)",
              f"- layout: {lay['devices']} GPUs, tp {lay['tp']}, ep {lay['ep']}, weights {doc['weight_dtype']}; "
              "one engine replica; the cache is what device memory leaves after the weights",
              "- engine arguments per stack (from its mechanisms or flags): " + "; ".join(
                  f"{n}: {json.dumps(a)}" for n, a in doc["engine_args"].items()),
              "- front end (HTTP, tokenisation): not modelled, zero"]
    lines += [f"- {a['name']}: {a['value']} — {a['source']}" for a in doc["assumptions"]]
    return "\n".join(lines)


def run_study(a: str, b: str, stacks: list[Stack], hardware: str, tp, ep, weight_dtype: str, cfg: BenchConfig,
              out_dir: Path, log=print) -> dict:
    roles = {("hybrid" if is_stateful(resolve_model(m).cfg) else "standard"): m for m in (a, b)}
    if len(roles) != 2:
        raise ValueError(f"compare --simulate needs one hybrid (linear-attention) and one standard model; "
                         f"{a} and {b} are both {next(iter(roles))}")
    out_dir.mkdir(parents=True, exist_ok=True)
    doc = Study(roles, hardware, tp, ep, weight_dtype, cfg, out_dir, log).run(stacks)
    md = report(doc)
    (out_dir / "compare.md").write_text(md)
    (out_dir / "compare.json").write_text(json.dumps(doc, indent=2, default=str))
    return {"markdown": md, "doc": doc}
