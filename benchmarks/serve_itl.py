"""`flashlane serve` ITL at concurrency 1 against the engine's own decode step.

Starts a server (extra flags after ``--``), streams one 64-token greedy completion a few times,
and compares the client-side inter-token latency with the decode steps the engine recorded
(``/debug/steps``); the offline step time to compare with comes from ``vs_transformers.py``.

    python benchmarks/serve_itl.py --model tiny-flash -- --compile --compile-sizes 1
"""

from __future__ import annotations

import argparse
import statistics
import time

import httpx
from common import served, write_result


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="tiny-flash")
    ap.add_argument("--port", type=int, default=18200)
    ap.add_argument("--runs", type=int, default=4, help="streams (the first is a warm-up)")
    ap.add_argument("--out")
    ap.add_argument("flags", nargs="*", help="flags for flashlane serve (after --)")
    args = ap.parse_args()
    url = f"http://127.0.0.1:{args.port}"
    with served(args.model, args.port, args.flags):
        body = {"model": args.model, "prompt": list(range(10, 74)), "max_tokens": 64, "temperature": 0,
                "ignore_eos": True, "stream": True}
        itls = []
        for run in range(args.runs):
            times = []
            with httpx.stream("POST", url + "/v1/completions", json=body, timeout=300) as r:
                times = [time.perf_counter() for line in r.iter_lines()
                         if line.startswith("data: ") and line != "data: [DONE]"]
            if run:
                itls.extend(b - a for a, b in zip(times[1:], times[2:]))
        steps = httpx.get(url + "/debug/steps", params={"limit": 100000}).json()["steps"]
        decode = [s for s in steps if s["prefill_tokens"] == 0]
        result = {"model": args.model, "flags": args.flags, "itl_median_ms": 1e3 * statistics.median(itls),
                  "engine_step_median_ms": 1e3 * statistics.median(s["end"] - s["start"] for s in decode),
                  "engine_model_median_ms": 1e3 * statistics.median(s["model_s"] for s in decode)}
        result["itl_over_engine_step"] = result["itl_median_ms"] / result["engine_step_median_ms"]
        write_result("serve_itl", result, args.out)


if __name__ == "__main__":
    main()
