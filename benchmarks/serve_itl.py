"""`flashlane serve` ITL at concurrency 1 against the engine's own decode step, and a storm.

Starts a server (extra flags after ``--``), streams one 64-token greedy completion a few times,
and compares the client-side inter-token latency with the decode steps the engine recorded
(``/debug/steps``); the offline step time to compare with comes from ``vs_transformers.py``.
Then ``--storm`` streams (64) start at once, each a 32-token greedy completion of its own prompt,
and the aggregate output tokens per second over the storm's wall-clock is reported (best of
``--storm-runs``, after one warm-up storm).

    python benchmarks/serve_itl.py --model tiny-flash -- --compile --compile-sizes 1
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import time

import httpx
from common import served, write_result


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="tiny-flash")
    ap.add_argument("--port", type=int, default=18200)
    ap.add_argument("--runs", type=int, default=4, help="streams (the first is a warm-up)")
    ap.add_argument("--storm", type=int, default=64, help="concurrent streams of the storm (0: none)")
    ap.add_argument("--storm-runs", type=int, default=3)
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
        if args.storm:
            rates = [asyncio.run(_storm(url, args.model, args.storm)) for _ in range(args.storm_runs + 1)][1:]
            result["storm"] = {"streams": args.storm, "tokens_per_stream": STORM_TOKENS,
                               "output_tok_s_runs": rates, "output_tok_s_best": max(rates)}
        result["load_average"] = os.getloadavg()
        write_result("serve_itl", result, args.out)


STORM_TOKENS = 32


async def _storm(url: str, model: str, streams: int) -> float:
    """Output tokens per second of ``streams`` concurrent greedy streams started at once."""
    import httpx

    async def one(client, i: int) -> int:
        body = {"model": model, "prompt": [10 + i % 50, *range(20, 52)], "max_tokens": STORM_TOKENS,
                "temperature": 0, "ignore_eos": True, "stream": True}
        n = 0
        async with client.stream("POST", url + "/v1/completions", json=body) as r:
            async for line in r.aiter_lines():
                n += line.startswith("data: {") and '"text"' in line
        return n

    limits = httpx.Limits(max_connections=streams + 4)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        started = time.perf_counter()
        chunks = await asyncio.gather(*(one(client, i) for i in range(streams)))
        elapsed = time.perf_counter() - started
    assert all(c >= STORM_TOKENS for c in chunks), chunks
    return streams * STORM_TOKENS / elapsed


if __name__ == "__main__":
    main()
