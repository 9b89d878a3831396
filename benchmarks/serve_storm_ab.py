"""A 64-stream storm against `flashlane serve` of this tree and of another tree, interleaved.

Each round starts a server from this tree, then one from ``--other-src`` (a ``git archive`` of an
older commit: ``PYTHONPATH`` points the server and its engine process at it), and runs a warm-up
storm plus ``--storms`` storms on each (``serve_itl._storm``: 64 greedy streams of 32 tokens).
Per side it reports the storms' output tok/s, the engine's busy share of the storms' wall-clock,
and, for the 64-sequence decode steps, the step time and its model part (``/debug/steps``), so a
throughput difference can be told apart from a difference in the model forward (which both
sides may share unchanged): step - model is the engine's own per-step overhead.

    git archive 5e29231 src | tar -x -C /tmp/old
    python benchmarks/serve_storm_ab.py --other-src /tmp/old/src --rounds 3
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time

from common import write_result

PROBE = r'''
import asyncio, json, sys, time, statistics, httpx
sys.path.insert(0, {bench!r})
from common import served
from serve_itl import _storm
url = "http://127.0.0.1:{port}"
with served("tiny-flash", {port}, []):
    asyncio.run(_storm(url, "tiny-flash", 64))
    t0 = time.time()
    rates = [asyncio.run(_storm(url, "tiny-flash", 64)) for _ in range({storms})]
    t1 = time.time()
    steps = httpx.get(url + "/debug/steps", params={{"limit": 100000}}).json()["steps"]
win = [s for s in steps if s["start"] >= t0 and s["end"] <= t1]
dec = [s for s in win if s["prefill_tokens"] == 0 and s["num_seqs"] >= 60]
print(json.dumps({{"output_tok_s": rates, "engine_busy_share": sum(s["end"] - s["start"] for s in win) / (t1 - t0),
                  "decode64_step_ms": 1e3 * statistics.median(s["end"] - s["start"] for s in dec),
                  "decode64_model_ms": 1e3 * statistics.median(s["model_s"] for s in dec)}}))
'''


def _side(src: str | None, port: int, storms: int) -> dict:
    env = dict(os.environ)
    if src:
        env["PYTHONPATH"] = src
    code = PROBE.format(bench=os.path.dirname(os.path.abspath(__file__)), port=port, storms=storms)
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=900)
    if out.returncode:
        raise RuntimeError(out.stderr[-2000:])
    r = json.loads(out.stdout.strip().splitlines()[-1])
    r["engine_overhead_ms"] = r["decode64_step_ms"] - r["decode64_model_ms"]
    r["load_average"] = os.getloadavg()
    return r


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--other-src", required=True, help="the src/ folder of the tree to compare with")
    ap.add_argument("--other-name", default="5e29231")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--storms", type=int, default=3)
    ap.add_argument("--port", type=int, default=18400)
    ap.add_argument("--out")
    args = ap.parse_args()
    rounds = []
    for i in range(args.rounds):
        this = _side(None, args.port + 2 * i, args.storms)
        other = _side(args.other_src, args.port + 2 * i + 1, args.storms)
        rounds.append({"this": this, "other": other,
                       "best_tok_s_ratio": max(this["output_tok_s"]) / max(other["output_tok_s"]),
                       "model_ms_ratio": this["decode64_model_ms"] / other["decode64_model_ms"]})
        print(json.dumps(rounds[-1]), flush=True)
    result = {"other": args.other_name, "rounds": rounds,
              "best_tok_s_ratio_median": statistics.median(r["best_tok_s_ratio"] for r in rounds),
              "engine_overhead_ms_this": statistics.median(r["this"]["engine_overhead_ms"] for r in rounds),
              "engine_overhead_ms_other": statistics.median(r["other"]["engine_overhead_ms"] for r in rounds)}
    write_result("serve_storm_ab", result, args.out)


if __name__ == "__main__":
    main()
