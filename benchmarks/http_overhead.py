"""What HTTP costs on top of LLM.generate: one short greedy request (8 tokens), in-process
`LLM.generate` against the same engine settings behind the server (non-streaming and streaming),
measured in turn within each round so a machine that gets busier or quieter slows all three.

Goal: the server adds milliseconds (a thread hop, JSON, a socket), not a multiple of the engine
time: median HTTP < 1.5 x LLM.generate + 50 ms.

    python benchmarks/http_overhead.py --rounds 7
"""

from __future__ import annotations

import argparse
import concurrent.futures
import os
import statistics
import sys
import time
from pathlib import Path

import httpx

from common import write_result

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="tiny-flash")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    from engine_models import preset
    from server_harness import ENGINE_ARGS, LiveServer

    from flashlane import LLM, SamplingParams

    loaded = preset(args.model)
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    llm = LLM(loaded, **ENGINE_ARGS)
    body = {"model": args.model, "prompt": "A short request", "max_tokens": 8, "temperature": 0, "ignore_eos": True}

    def offline_once():
        t = time.perf_counter()
        llm.generate("A short request", params)
        return time.perf_counter() - t

    # the server's engine steps on a thread of its own, so LLM.generate runs on one too (torch's
    # CPU threading differs between the main thread and others)
    with LiveServer(loaded, args.model) as srv, httpx.Client(base_url=srv.url, timeout=120) as c, \
            concurrent.futures.ThreadPoolExecutor(max_workers=1) as worker:
        worker.submit(llm.generate, "warm up", params).result()
        c.post("/v1/completions", json=body)
        offline, plain, streamed = [], [], []
        for _ in range(args.rounds):
            offline.append(worker.submit(offline_once).result())
            t = time.perf_counter()
            assert c.post("/v1/completions", json=body).status_code == 200
            plain.append(time.perf_counter() - t)
            t = time.perf_counter()
            with c.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
                for _ in r.iter_lines():
                    pass
            streamed.append(time.perf_counter() - t)
    med = {k: statistics.median(v) * 1000 for k, v in
           (("llm_generate_ms", offline), ("http_ms", plain), ("http_stream_ms", streamed))}
    bound = 1.5 * med["llm_generate_ms"] + 50
    write_result("http_overhead", {
        "model": args.model, "rounds": args.rounds, "load_average": os.getloadavg(), "median": med,
        "goal_ms": bound, "met": med["http_ms"] < bound and med["http_stream_ms"] < bound,
    }, args.out)


if __name__ == "__main__":
    main()
