"""How far does `flashlane simulate` hold on this machine? Simulated against measured, on the agentic
workload (issue 24's validation).

Parts (each writes its results into the JSON as soon as it is done):
  tiny-c1   `flashlane compare` at concurrency 1 (tiny-flash vs tiny-standard, the three stacks, 4 tasks
            each, the long workload): every measured side is replayed by the simulator beside it
  tiny-c4   the same at concurrency 4 (8 tasks per side in 2 interleaved rounds)
  smollm2   SmolLM2-135M served by `flashlane serve` (flashlane stack flags) and benchmarked on the
            medium agentic workload (its 8K context) at concurrency 1 (4 tasks) and 8 (8 tasks),
            then the same bench config simulated

Step costs come from `flashlane calibrate` of this machine in the servers' mode (compare's calibration
grid, cached under $FLASHLANE_CACHE/calibrations), never from the measured runs. The machine's speed
is probed before every measured round and after the last (`simulate.speed_probe`: a matmul, a weight read and small ops in
the servers' dtype and threads, against the same probe taken while the calibration ran); each side is
simulated at that speed, and as calibrated beside it (`figures_as_calibrated`). Checked per side:
per-task latency mean within 10% (aim 5%), TTFT mean and ITL mean within 15%, prefix-cache hit within
0.02, and per stack the simulated hybrid/standard ratio inside the measured 95% CI; reported too: the
per-step error (median and p90 |sim - measured| / measured over the engine's step records).

    python benchmarks/simulate_validation.py [--parts tiny-c1,tiny-c4,smollm2] [--out FILE] [--quick]
    python benchmarks/simulate_validation.py --parts smollm2 --resimulate WORK_DIR --calibration FILE

--quick: the small workload and one or two tasks (a smoke run of the script, not a validation).
About 25 min for tiny-c1, 25-35 for tiny-c4 and 10 for smollm2 on 2 cores, plus the calibrations once:
2-5 min per tiny preset, 30 min for SmolLM2 (fp32, 1 thread, on a Zen 3 core with AVX2 only).
--resimulate takes seconds: the simulator in virtual time over measured runs kept with --keep (or the
temporary folder a run printed).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

from common import machine

ROOT = Path(__file__).resolve().parents[1]
GOALS = {"task_s": 0.10, "ttft_s": 0.15, "itl_s": 0.15, "prefix_hit": 0.02}
SMOLLM2 = "smollm2-135m"
SMOLLM2_FLAGS = ["--enable-prefix-caching", "--max-wait-ms", "2"]     # the flashlane stack's
SMOLLM2_SCALE = "medium"     # contexts up to 1.5K tokens: the long workload (12K) overflows SmolLM2's 8K


def check_side(fig: dict) -> dict:
    out = {}
    for name, limit in GOALS.items():
        err = fig[name]["error"]
        out[name] = None if err is None else abs(err) <= limit
    return out


def as_calibrated(sim: dict) -> dict:
    """The machine's speed during the side's rounds against its calibration's, and the figures
    simulated without that scaling (the simulator before speed probes)."""
    fig = sim.get("figures_as_calibrated")
    return {"drift": sim.get("drift"), "drift_missing": sim.get("drift_missing"), "figures_as_calibrated": fig,
            "checks_as_calibrated": check_side(fig) if fig else None}


def compare_part(concurrency: int, sessions: int | None, quick: bool, work: Path, log) -> dict:
    out = work / f"compare_c{concurrency}"
    cmd = [sys.executable, "-m", "flashlane.cli.main", "compare", "--concurrency", str(concurrency), "--no-profile",
           "--no-progress", "--no-record", "--output-dir", str(out)]
    if sessions:
        cmd += ["--num-sessions", str(sessions)]
    if quick:
        cmd += ["--scale", "small", "--calibration-grid", "quick"]
    log(" ".join(cmd[3:]))
    t0 = time.monotonic()
    r = subprocess.run(cmd, capture_output=True, text=True, cwd=work)
    if r.returncode != 0:
        return {"error": r.stderr[-3000:], "command": cmd[3:]}
    doc = json.loads((out / "compare.json").read_text())
    sides = []
    for key, points in doc["points"].items():
        stack, model = key.split("/", 1)
        for p in points:
            sim = p.get("simulated")
            if not sim:
                continue
            step = (sim.get("per_step") or {}).get("all") or {}
            sides.append({"stack": stack, "model": model, "load": p["label"], "figures": sim["figures"],
                          "per_step": {k: step.get(k) for k in ("steps", "median_rel_error", "p90_rel_error")},
                          "per_step_by_kind": sim.get("per_step"), "checks": check_side(sim["figures"]),
                          **as_calibrated(sim)})
    return {"command": cmd[3:], "wall_s": time.monotonic() - t0, "answer": doc["answer"], "sides": sides,
            "ratios": doc["simulated_ratios"], "counterfactual": doc.get("counterfactual"),
            "calibrations": doc.get("calibrations"), "conditions": doc.get("conditions_resolved")}


def _smollm2_config(c: int, n: int, quick: bool, base_url: str, output_dir: Path, server_pid: int | None):
    from flashlane.bench.runner import BenchConfig

    return BenchConfig(base_url=base_url, output_dir=str(output_dir), model=SMOLLM2, workload="agentic",
                       scale="small" if quick else SMOLLM2_SCALE, concurrency=[c], num_sessions=n,
                       warmup="requests", seed=0, progress=False, server_pid=server_pid)


def _smollm2_loads(quick: bool) -> list[tuple[int, int]]:
    return [(1, 1 if quick else 4), (8, 2 if quick else 8)]


def smollm2_part(quick: bool, work: Path, log, resimulate: Path | None = None,
                 calibration: str | None = None) -> dict:
    """Measure SmolLM2 served at c1 and c8, then simulate the same configs. ``resimulate``: a kept
    work folder of an earlier run whose measured runs are simulated again (with ``calibration``,
    the file that run used, or else this machine's cached one) instead of measuring."""
    from flashlane import presets
    from flashlane.analyze.calibration import load_calibration
    from flashlane.bench.runner import build_source, run_bench, run_point
    from flashlane.bench.server_launch import ServerProcess, free_port, serve_command
    from flashlane.bench.text_synth import TextSynth
    from flashlane.cli.compare import equal_conditions
    from flashlane.cli.compare_simulation import LocalSimulator, figures, per_step_error
    from flashlane.simulate.run import BASE_URL, SimulatedServer
    from flashlane.simulate.setup import calibrated

    t0 = time.monotonic()
    extra, conditions = equal_conditions([], log)
    flags = extra + SMOLLM2_FLAGS
    sim = LocalSimulator(extra, work / "smollm2", log=log, grid="quick" if quick else "compare", max_batch=8)
    args = sim.engine_args(SMOLLM2_FLAGS)
    if calibration:
        cal, cal_path = load_calibration(calibration, machine=sim.machine)[0], calibration
    else:
        cal, cal_path = sim.calibration(SMOLLM2, args)
    if cal is None:
        return {"error": "no calibration of smollm2-135m could be made"}
    measured, probes = {}, {}
    if resimulate is not None:
        for c, n in _smollm2_loads(quick):
            run_dir = resimulate / "smollm2" / f"measured_c{c}"
            measured[c] = (_smollm2_config(c, n, quick, BASE_URL, run_dir, None),
                           json.loads((run_dir / "summary.json").read_text()), run_dir)
    else:
        port = free_port()
        with ServerProcess(serve_command(SMOLLM2, port, None, flags), f"http://127.0.0.1:{port}",
                           work / "smollm2" / "server.log") as srv:
            for c, n in _smollm2_loads(quick):
                cfg = _smollm2_config(c, n, quick, f"http://127.0.0.1:{port}", work / "smollm2" / f"measured_c{c}",
                                      srv.pid)
                log(f"smollm2 measured c{c}, {n} tasks")
                sim.between_rounds("flashlane", f"c{c}", 0)
                (_, summary, run_dir), = run_bench(cfg, resolve_tokenizer=presets.tokenizer_file)
                sim.between_rounds("flashlane", f"c{c}", 1)
                probes[c] = [sim.probes[("flashlane", f"c{c}", p)] for p in (0, 1)]
                measured[c] = (cfg, summary, run_dir)
    sides = []
    servers = {drifted: SimulatedServer(calibrated(SMOLLM2, cal, args, sim.machine)[0]) for drifted in (True, False)}
    for c, _ in _smollm2_loads(quick):
        cfg, summary, run_dir = measured[c]
        speed, why = sim.drift(cal, probes.get(c, []))

        def simulate(drifted: bool) -> dict:
            server = servers[drifted]
            server.retime(calibrated(SMOLLM2, cal, args, sim.machine, drift=speed if drifted else None)[0])
            where = work / "smollm2" / (f"simulated_c{c}" if drifted else f"simulated_c{c}_as_calibrated")
            scfg = replace(cfg, base_url=BASE_URL, output_dir=str(where), server_pid=None)
            synth = TextSynth(seed=cfg.seed)     # as the measured run: no tokenizer file for the GGUF preset
            return figures(summary, run_point(scfg, build_source(scfg), synth, cfg.load_points()[0], where,
                                              server.harness()))

        fig = simulate(True)
        steps = per_step_error(cal, SMOLLM2, [run_dir], speed)
        sides.append({"stack": "flashlane", "model": SMOLLM2, "load": f"c{c}", "figures": fig,
                      "per_step": {k: (steps or {}).get("all", {}).get(k) for k in ("steps", "median_rel_error",
                                                                                   "p90_rel_error")},
                      "per_step_by_kind": steps, "checks": check_side(fig),
                      **as_calibrated({"drift": speed.to_dict() if speed else None, "drift_missing": why,
                                       "figures_as_calibrated": simulate(False) if speed else None})})
    return {"wall_s": time.monotonic() - t0, "flags": flags, "conditions": conditions, "calibration": cal_path,
            "resimulated": str(resimulate) if resimulate else None,
            "calibration_fit": cal.fit.get("by_kind"), "front_end": cal.front_end, "sides": sides}


def summarize(parts: dict) -> dict:
    sides = [s for p in parts.values() if isinstance(p, dict) for s in p.get("sides", [])]
    ratios = [r for p in parts.values() if isinstance(p, dict) for r in p.get("ratios", [])]

    def all_true(name):
        vals = [s["checks"][name] for s in sides if s["checks"].get(name) is not None]
        return {"passed": sum(vals), "of": len(vals)}

    def abs_errors(key):
        return sorted(abs(e) for s in sides if (e := ((s.get(key) or {}).get("task_s") or {}).get("error")) is not None)

    errs, as_cal = abs_errors("figures"), abs_errors("figures_as_calibrated")
    return {"sides": len(sides), **{f"within_goal_{k}": all_true(k) for k in GOALS},
            "ratio_inside_ci": {"passed": sum(1 for r in ratios if r["inside_ci"]), "of": len(ratios)},
            "task_error_abs_max": errs[-1] if errs else None,
            "task_error_abs_median": statistics.median(errs) if errs else None,
            "as_calibrated": {"sides": len(as_cal), "task_error_abs_max": as_cal[-1] if as_cal else None,
                              "task_error_abs_median": statistics.median(as_cal) if as_cal else None,
                              "ratios": [r.get("simulated_as_calibrated") for r in ratios]}}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--parts", default="tiny-c1,tiny-c4,smollm2")
    ap.add_argument("--out", default="benchmarks/results/simulate_validation.json")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--keep", default=None, help="folder for the runs (default: a temporary one)")
    ap.add_argument("--resimulate", default=None, metavar="WORK_DIR",
                    help="smollm2 part: simulate the measured runs of an earlier run's work folder again "
                         "(this code's simulator) instead of measuring")
    ap.add_argument("--calibration", default=None, help="with --resimulate: the calibration file that run used")
    args = ap.parse_args()
    if args.calibration and not args.resimulate:
        ap.error("--calibration goes with --resimulate (a measuring run calibrates, or reuses this machine's)")
    if args.resimulate and {p.strip() for p in args.parts.split(",") if p.strip()} != {"smollm2"}:
        ap.error("--resimulate applies to the smollm2 part only: pass --parts smollm2")
    log = lambda m: print(m, file=sys.stderr, flush=True)   # noqa: E731
    work = Path(args.keep or tempfile.mkdtemp(prefix="flashlane-simval-"))
    work.mkdir(parents=True, exist_ok=True)
    out = Path(args.out)
    doc = json.loads(out.read_text()) if out.is_file() else {}
    doc.update({"benchmark": "simulate_validation", "machine": machine(), "goals": GOALS, "quick": args.quick,
                "work_dir": str(work)})
    doc.setdefault("parts", {})
    runners = {"tiny-c1": lambda: compare_part(1, None, args.quick, work, log),
               "tiny-c4": lambda: compare_part(4, 2 if args.quick else 8, args.quick, work, log),
               "smollm2": lambda: smollm2_part(args.quick, work, log,
                                               Path(args.resimulate) if args.resimulate else None, args.calibration)}
    for name in [p.strip() for p in args.parts.split(",") if p.strip()]:
        if name not in runners:
            ap.error(f"--parts: unknown part {name!r} (known: {', '.join(runners)})")
        log(f"== {name}")
        doc["parts"][name] = {**runners[name](), "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
        doc["summary"] = summarize(doc["parts"])
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(doc, indent=2, default=str))
        log(json.dumps(doc["summary"]))
    print(json.dumps(doc["summary"], indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
