"""Does `flashlane compare`'s answer hold on a busy machine? The default run, twice on an idle
machine and twice beside a co-tenant that keeps one core busy (a bounded spin loop at nice 0,
started and stopped here), in the order idle, busy, idle, busy so slow drift of the machine hits
both conditions. Passes when every run gives the same verdict per stack and the hybrid-cache-gap
ratios' point estimates lie within each other's CIs.

    python benchmarks/compare_under_load.py [--runs 4] [--out benchmarks/results/compare_under_load.json]
        [-- extra compare arguments]
    python benchmarks/compare_under_load.py --rerun 1 --reason "..." --out FILE   # repeat run 1 of FILE

`--rerun` repeats the named runs of an earlier result (same condition, same position in the
order) and keeps the runs it replaces under `discarded`, with the reason, in the JSON.

Runs `flashlane compare` from a snapshot of src/ taken at start (so editing the tree meanwhile
does not change what is measured). About 20 min per idle run and 25 per busy one on 2 cores.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import write_result

ROOT = Path(__file__).resolve().parents[1]
SPIN = ("import time, sys\nend = time.monotonic() + float(sys.argv[1])\n"
        "while time.monotonic() < end:\n    pass\n")
GAP = "hybrid-cache-gap"


def snapshot_src() -> Path:
    folder = Path(tempfile.mkdtemp(prefix="flashlane-src-"))
    shutil.copytree(ROOT / "src", folder / "src", ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    return folder / "src"


def run_once(i: int, busy: bool, src: Path, out_root: Path, extra: list[str], max_s: float) -> dict:
    out = out_root / f"run{i}_{'busy' if busy else 'idle'}"
    env = {**os.environ, "PYTHONPATH": str(src)}
    spinner = None
    if busy:  # one core kept busy at the default priority; bounded so it cannot outlive a crash
        spinner = subprocess.Popen([sys.executable, "-c", SPIN, str(max_s)])
    t0 = time.monotonic()
    try:
        r = subprocess.run([sys.executable, "-m", "flashlane.cli.main", "compare", "--output-dir", str(out),
                            "--no-progress", "--no-record", *extra], env=env, capture_output=True, text=True,
                           timeout=max_s, cwd=out_root)
    finally:
        if spinner is not None:
            spinner.kill()
            spinner.wait()
    wall = time.monotonic() - t0
    res = {"run": i, "co_tenant": "one spinning core (nice 0)" if busy else "none", "rc": r.returncode,
           "wall_s": wall, "folder": str(out), "stderr_tail": r.stderr[-2000:] if r.returncode else ""}
    if r.returncode != 0:
        return res
    doc = json.loads((out / "compare.json").read_text())
    res["answer"] = doc["answer"]
    res["conditions"] = doc.get("conditions")
    res["findings"] = {f["stack"]: {"load": f["load"], "ratio": f["ratio"], "ci": f["ci"], "verdict": f["verdict"],
                                    "engine": f.get("engine"), "cpu": f.get("cpu"), "noisy": f["noisy"]}
                       for f in doc["findings"]}
    rounds = [r for pts in doc["points"].values() for p in pts for r in p.get("rounds", [])]
    cot = [r["machine_load"].get("cotenant_cpu_percent") for r in rounds if r.get("machine_load")]
    cot = [c for c in cot if c is not None]
    res["cotenant_cpu_percent"] = {"mean": sum(cot) / len(cot), "max": max(cot)} if cot else None
    return res


def verdicts_agree(runs: list[dict]) -> dict:
    ok = [r for r in runs if r.get("findings")]
    stacks = sorted({s for r in ok for s in r["findings"]})
    per_stack = {s: [r["findings"][s]["verdict"] for r in ok if s in r["findings"]] for s in stacks}
    gap = [r["findings"][GAP] for r in ok if GAP in r["findings"]]
    within = all(g["ci"] and g["ci"]["low"] <= h["ratio"] <= g["ci"]["high"] for g in gap for h in gap)
    half = [(g["ci"]["high"] - g["ci"]["low"]) / 2 / g["ratio"] for g in gap if g["ci"] and g["ci"]["low"]]
    return {"all_runs_finished": len(ok) == len(runs),
            "verdicts": per_stack, "same_verdict_per_stack": all(len(set(v)) == 1 for v in per_stack.values()),
            "gap_ratios": [g["ratio"] for g in gap], "gap_points_within_each_others_ci": within,
            "gap_ci_half_width_relative": half}


def write(args, runs: list[dict], discarded: list[dict]) -> None:
    doc = {"command": "flashlane compare " + " ".join(args.extra), "runs": runs, "checks": verdicts_agree(runs)}
    if discarded:
        doc["discarded"] = discarded
    write_result("compare_under_load", doc, args.out)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=4, help="runs, alternating idle and busy (default 4)")
    ap.add_argument("--out", default=None)
    ap.add_argument("--work", default=None, help="folder for the compare outputs (default: a temp folder)")
    ap.add_argument("--max-run-s", type=float, default=3600.0)
    ap.add_argument("--src", default=None, help="run compare from this src/ folder instead of a snapshot of "
                    "this tree's (a rerun must measure the code the other runs measured)")
    ap.add_argument("--rerun", default=None, help="comma-separated run numbers of --out to repeat")
    ap.add_argument("--reason", default=None, help="why the --rerun runs are repeated (required with it)")
    ap.add_argument("extra", nargs="*", help="extra `flashlane compare` arguments (after --)")
    args = ap.parse_args()
    previous, discarded, redo = None, [], None
    if args.rerun is not None:
        if not args.out or not args.reason:
            ap.error("--rerun needs --out (the earlier result) and --reason")
        previous = json.loads(Path(args.out).read_text())
        redo = {int(i) for i in args.rerun.split(",")}
        if not redo <= set(range(len(previous["runs"]))):
            ap.error(f"--rerun {args.rerun}: {args.out} has runs 0-{len(previous['runs']) - 1}")
        discarded = previous.get("discarded", [])
        args.runs = len(previous["runs"])
    src = Path(args.src).resolve() if args.src else snapshot_src()
    work = Path(args.work or tempfile.mkdtemp(prefix="flashlane-cul-"))
    work.mkdir(parents=True, exist_ok=True)
    runs: list[dict] = []
    for i in range(args.runs):
        if previous is not None and i not in redo:
            runs.append(previous["runs"][i])
            continue
        if previous is not None:
            discarded.append({**previous["runs"][i], "discarded_because": args.reason})
        busy = i % 2 == 1
        print(f"run {i} ({'busy' if busy else 'idle'}) ...", file=sys.stderr, flush=True)
        runs.append({**run_once(i, busy, src, work, args.extra, args.max_run_s), "src": str(src)})
        print(f"  {runs[-1].get('answer') or runs[-1]['stderr_tail']}", file=sys.stderr, flush=True)
        pending = previous["runs"][len(runs):] if previous else []
        write(args, runs + pending, discarded)
    write(args, runs, discarded)
    checks = verdicts_agree(runs)
    return 0 if checks["same_verdict_per_stack"] and checks["gap_points_within_each_others_ci"] else 1


if __name__ == "__main__":
    sys.exit(main())
