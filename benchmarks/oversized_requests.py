"""What one oversized request costs everyone else on a `flashlane serve` (issue 13, item 1).

Starts a server, then sends each oversized body in turn while, alongside, ``/health`` is polled
every 20 ms and a small greedy stream runs; a baseline phase with no oversized request comes
first, under the same load. Records each body's answer, the /health latencies, the stream's
inter-token latency, and the server's RSS (HTTP and engine processes) before and after.

    python benchmarks/oversized_requests.py [--model tiny-flash] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import threading
import time
from concurrent.futures import ProcessPoolExecutor

import httpx
import psutil
from common import served, write_result

STREAM = {"prompt": "hello", "max_tokens": 48, "temperature": 0, "ignore_eos": True, "stream": True}


def bodies(model: str) -> dict[str, tuple[str, bytes]]:
    one = b'{"role": "user", "content": "hi"}'
    bias = b",".join(b'"%d": 1.5' % i for i in range(2_000_000))
    return {
        "prompt_30mb": ("/v1/completions", json.dumps({"model": model, "prompt": "hello world " * 2_500_000,
                                                       "max_tokens": 4}).encode()),
        "chat_30mb": ("/v1/chat/completions", json.dumps({"model": model, "max_tokens": 4, "messages": [
            {"role": "user", "content": "hello world " * 2_500_000}]}).encode()),
        "two_million_prompts": ("/v1/completions", b'{"max_tokens": 1, "prompt": ['
                                + b",".join([b'"a"'] * 2_000_000) + b"]}"),
        "900k_messages": ("/v1/chat/completions", b'{"max_tokens": 1, "messages": ['
                          + b",".join([one] * 900_000) + b"]}"),
        "logit_bias_2m": ("/v1/completions", b'{"prompt": "hi", "max_tokens": 1, "logit_bias": {' + bias + b"}}"),
    }


def rss_mib(pid: int) -> float:
    proc = psutil.Process(pid)
    procs = [proc] + proc.children(recursive=True)
    total = 0
    for p in procs:
        try:
            total += p.memory_info().rss
        except psutil.NoSuchProcess:
            pass
    return total / 2**20


def summary(xs: list[float]) -> dict:
    if not xs:
        return {"n": 0}
    xs = sorted(xs)
    return {"n": len(xs), "median_ms": 1e3 * statistics.median(xs),
            "p99_ms": 1e3 * xs[min(len(xs) - 1, int(0.99 * len(xs)))], "max_ms": 1e3 * xs[-1]}


def stream_itls(url: str, model: str) -> list[float]:
    times = []
    with httpx.stream("POST", url + "/v1/completions", json={"model": model, **STREAM}, timeout=120) as r:
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                times.append(time.perf_counter())
    return [b - a for a, b in zip(times[1:], times[2:])]


def phase(url: str, model: str, big: tuple[str, bytes] | None, streamer: ProcessPoolExecutor,
          min_s: float = 4.0) -> dict:
    """/health and a stream's ITL while ``big`` (None: nothing) is sent and answered. The stream
    is read in another process, so that sending the body here cannot delay its tokens."""
    answer: dict = {}

    def send():
        t = time.perf_counter()
        path, body = big
        r = httpx.post(url + path, content=body, headers={"content-type": "application/json"}, timeout=300)
        err = r.json().get("error", {}) if r.status_code >= 400 else {}
        answer.update(status=r.status_code, seconds=time.perf_counter() - t, code=err.get("code"),
                      param=err.get("param"), message=(err.get("message") or "")[:160])

    sender = threading.Thread(target=send) if big else None
    health: list[float] = []
    with httpx.Client(base_url=url, timeout=60) as c:
        c.get("/health")
        stream = streamer.submit(stream_itls, url, model)
        if sender:
            sender.start()
        t0 = time.perf_counter()
        while (sender and sender.is_alive()) or not stream.done() or time.perf_counter() - t0 < min_s:
            t = time.perf_counter()
            assert c.get("/health").status_code == 200
            health.append(time.perf_counter() - t)
            time.sleep(0.02)
    return {"answer": answer or None, "health": summary(health), "stream_itl": summary(stream.result())}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="tiny-flash")
    ap.add_argument("--port", type=int, default=18300)
    ap.add_argument("--out")
    args = ap.parse_args()
    url = f"http://127.0.0.1:{args.port}"
    with served(args.model, args.port) as server, ProcessPoolExecutor(1) as streamer:
        phase(url, args.model, None, streamer, min_s=1.0)  # warm-up
        result = {"model": args.model, "load_average_before": os.getloadavg(),
                  "baseline": phase(url, args.model, None, streamer), "cases": {}}
        for name, big in bodies(args.model).items():
            before = rss_mib(server.pid)
            case = phase(url, args.model, big, streamer)
            time.sleep(2.0)  # the memory releaser runs at most once a second
            case.update(rss_before_mib=before, rss_after_2s_mib=rss_mib(server.pid), body_mib=len(big[1]) / 2**20)
            case["rss_change"] = case["rss_after_2s_mib"] / before - 1
            result["cases"][name] = case
        result["baseline_after"] = phase(url, args.model, None, streamer)
        result["load_average_after"] = os.getloadavg()
        write_result("oversized_requests", result, args.out)


if __name__ == "__main__":
    main()
