"""Issue 23 (a): n-gram speculative decoding on SmolLM2-135M, served by `flashlane serve`, on the
agentic replay at concurrency 1, against the same server with speculation off. Both servers are
up throughout with the same dtype and threads; each round runs the same `flashlane bench`
workload (greedy, same seed) on both in ABBA order, so each round gives one pair per metric.
Reported: per-task latency, ITL, time per output token and decode tok/s per request (paired
ratios off/on, > 1 means speculation is faster), the real acceptance from the server's own
Prometheus counters (drafts, draft tokens, accepted tokens, mean acceptance length), and whether
every request of a round produced as many tokens on both sides (greedy: they must).

    python benchmarks/speculative.py                      # -> benchmarks/results/speculative.json
    python benchmarks/speculative.py --quick --out /tmp/speculative.json
    python benchmarks/speculative.py --compile            # both servers with static graphs
                                                          # -> benchmarks/results/speculative_static.json
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import vs_vllm_cpu as vv
from common import write_result

MODEL = "smollm2-135m"
SIDES = ("off", "ngram")
# metric -> (path into a bench summary.json, True when higher is better)
METRICS = {
    "task_latency_mean_s": (("task_latency_s", "mean"), False),
    "itl_mean_s": (("itl_s", "mean"), False),
    "tpot_mean_s": (("tpot_s", "mean"), False),
    "decode_tok_s_per_request": (("interactivity_tok_s", "mean"), True),
}
SPEC_COUNTERS = ("spec_decode_num_drafts", "spec_decode_num_draft_tokens", "spec_decode_num_accepted_tokens")
GOAL = 1.5      # decode tok/s per request, ngram / off


def bench_args(quick: bool, sessions: int) -> list[str]:
    return ["--workload", "agentic", "--scale", "small" if quick else "medium", "--concurrency", "1",
            "--num-sessions", str(sessions), "--think-scale", "0.1"]


def spec_counters(url: str) -> dict[str, float]:
    import httpx

    text = httpx.get(url + "/metrics", timeout=10.0).text
    out = {}
    for name in SPEC_COUNTERS:
        m = re.search(rf"^flashlane:{name}_total\{{[^}}]*\}} ([0-9.eE+-]+)$", text, re.M)
        out[name] = float(m.group(1)) if m else 0.0
    return out


def metric(summary: dict, name: str) -> float | None:
    node = summary
    for key in METRICS[name][0]:
        node = node.get(key) if isinstance(node, dict) else None
    return float(node) if isinstance(node, (int, float)) else None


def run_once(server: vv.Server, args: list[str], seed: int, out_dir: Path) -> dict:
    cmd = [sys.executable, "-m", "flashlane.cli.main", "bench", "--base-url", server.url, "--model", MODEL, *args,
           "--seed", str(seed), "--temperature", "0", "--output-dir", str(out_dir), "--no-progress",
           "--no-record", "--no-telemetry", "--server-pid", str(server.proc.pid)]
    before = spec_counters(server.url)
    load = os.getloadavg()[0]
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    after = spec_counters(server.url)
    path = out_dir / "summary.json"
    if done.returncode != 0 or not path.is_file():
        return {"valid": False, "error": f"bench exited {done.returncode}: {done.stderr[-2000:]}", "metrics": {}}
    summary = json.loads(path.read_text())
    spec = {k: after[k] - before[k] for k in SPEC_COUNTERS}
    drafts = spec["spec_decode_num_drafts"]
    spec["mean_acceptance_length"] = 1 + spec["spec_decode_num_accepted_tokens"] / drafts if drafts else None
    return {"valid": bool(summary["validity"]["valid"]), "reasons": summary["validity"]["reasons"],
            "metrics": {m: metric(summary, m) for m in METRICS}, "speculation": spec,
            "output_tokens": _output_tokens(out_dir), "load_average_1m": load, "folder": str(out_dir)}


def _output_tokens(run_dir: Path) -> dict[str, int]:
    """Output tokens per request id: greedy speculation must give the same lengths as off."""
    out = {}
    for line in (run_dir / "requests.jsonl").read_text().splitlines():
        r = json.loads(line)
        out[r["request_id"]] = r.get("output_tokens")
    return out


def paired(per_round: list[dict]) -> dict:
    from flashlane.bench.stats import paired_ratio_ci

    out = {}
    for name, (_, higher_better) in METRICS.items():
        pairs: dict[int, dict] = {}
        for r in per_round:
            if r["valid"] and r["metrics"].get(name) is not None:
                pairs.setdefault(r["round"], {})[r["side"]] = r["metrics"][name]
        rounds = sorted(k for k, v in pairs.items() if all(s in v for s in SIDES))
        off = [pairs[k]["off"] for k in rounds]
        on = [pairs[k]["ngram"] for k in rounds]
        ratio = None
        if len(rounds) >= 2:
            ratio = paired_ratio_ci(on, off) if higher_better else paired_ratio_ci(off, on)
        elif len(rounds) == 1:
            ratio = {"ratio": on[0] / off[0] if higher_better else off[0] / on[0], "low": None, "high": None,
                     "n_pairs": 1}
        out[name] = {"rounds": rounds, "off": off, "ngram": on, "speedup": ratio}
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="smoke run: the small workload, 1 session, 2 rounds")
    ap.add_argument("--rounds", type=int, default=None, help="ABBA rounds (default 4; --quick 2)")
    ap.add_argument("--sessions", type=int, default=None, help="agentic sessions per run (default 2; --quick 1)")
    ap.add_argument("--k", type=int, default=3, help="num_speculative_tokens (default 3)")
    ap.add_argument("--threads", type=int, default=None, help="threads of both servers (default: CPUs less one)")
    ap.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    ap.add_argument("--compile", action="store_true",
                    help="both servers with static graphs (--compile): verify steps run in the decode graphs")
    ap.add_argument("--work-dir", default=None)
    ap.add_argument("--out", default=None, help="JSON path (default benchmarks/results/speculative.json)")
    args = ap.parse_args(argv)
    rounds = args.rounds or (2 if args.quick else 4)
    sessions = args.sessions or (1 if args.quick else 2)
    threads = args.threads or vv.default_threads()
    dtype, dtype_reason = vv.resolve_dtype(args.dtype, threads)
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="flashlane-speculative-"))
    work.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, OMP_NUM_THREADS=str(threads))
    env.pop("FLASHLANE_API_KEY", None)
    spec = json.dumps({"method": "ngram", "num_speculative_tokens": args.k})
    servers = {}
    graphs = ["--compile"] if args.compile else []
    for side, extra in (("off", graphs), ("ngram", graphs + ["--speculative-config", spec])):
        port = vv.free_port()
        servers[side] = vv.Server(side, vv.flashlane_command(MODEL, port, dtype, threads, extra), port, env,
                                  work / f"{side}.log", 600.0)
    wl = bench_args(args.quick, sessions)
    per_round: list[dict] = []
    result = {"model": MODEL, "cpu": vv.cpu_info(), "dtype": dtype,
              "dtype_reason": dtype_reason, "threads": threads, "speculative_config": json.loads(spec),
              "static_graphs": args.compile,
              "quick": args.quick, "rounds": rounds, "order": "ABBA per round, A=off", "workload": wl,
              "goal": {"decode_tok_s_per_request": GOAL}, "work_dir": str(work)}
    t0 = time.monotonic()
    try:
        for s in servers.values():
            s.start()
        result["commands"] = {n: shlex.join(s.command) for n, s in servers.items()}
        for r, side in vv.abba(rounds, SIDES):
            run = run_once(servers[side], wl, 2000 + r, work / f"r{r}-{side}")
            per_round.append({"round": r, "side": side, **run})
            print(f"round {r} {side}: {run['metrics']} {run.get('speculation')}", file=sys.stderr, flush=True)
    finally:
        for s in servers.values():
            s.stop()
    spec_runs = [r["speculation"] for r in per_round if r["side"] == "ngram" and r.get("speculation")]
    drafts = sum(s["spec_decode_num_drafts"] for s in spec_runs)
    accepted = sum(s["spec_decode_num_accepted_tokens"] for s in spec_runs)
    drafted = sum(s["spec_decode_num_draft_tokens"] for s in spec_runs)
    by_round = [[r.get("output_tokens") for r in per_round if r["round"] == k and r["valid"]] for k in range(rounds)]
    same_output = [len(sides) == 2 and sides[0] == sides[1] for sides in by_round]
    result.update({
        "wall_s": time.monotonic() - t0, "runs": per_round, "paired": paired(per_round),
        "acceptance": {"drafts": drafts, "draft_tokens": drafted, "accepted_tokens": accepted,
                       "mean_acceptance_length": 1 + accepted / drafts if drafts else None,
                       "acceptance_rate": accepted / drafted if drafted else None},
        "same_output_lengths_per_round": same_output,
    })
    speed = result["paired"]["decode_tok_s_per_request"]["speedup"]
    result["meets_goal"] = None if speed is None else speed["ratio"] >= GOAL
    write_result("speculative_static" if args.compile else "speculative", result, args.out)


if __name__ == "__main__":
    main()
