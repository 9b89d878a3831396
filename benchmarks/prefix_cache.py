"""Prefix cache on real servers: caching off vs on vs on with a pool too small plus a host tier,
for tiny-flash and tiny-standard, on the default agentic workload and on long multi-turn
sessions (contexts growing past 8K tokens); plus an in-process host-tier-hit vs recompute timing.

Per (model, configuration, workload): mean / p90 TTFT, TTFT of the last turn of each session,
per-task latency, the server-reported and the theoretical prefix-cache hit rate, and the bytes
of one state checkpoint. Everything runs through `flashlane serve` and `flashlane bench`'s
harness over HTTP, at concurrency 1, with the same seeded sessions for every configuration.

    python benchmarks/prefix_cache.py                 # everything (~20 min on 2 cores)
    python benchmarks/prefix_cache.py --quick         # fewer sessions
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

from common import write_result

from flashlane.bench.workloads.multiturn import MultiTurnSpec
from flashlane.bench.runner import BenchConfig, run_bench
from flashlane.bench.server_launch import ServerProcess, free_port, serve_command

MODELS = ("tiny-flash", "tiny-standard")
COMMON = ["--dtype", "float32", "--max-model-len", "16384", "--num-threads", "2"]
CONFIGS = {
    "off": ["--no-enable-prefix-caching"],
    "on": [],
    # a pool of 12.8K tokens: one long session at a time (the other sessions spill to a 256 MiB host tier)
    "small_pool+host": ["--num-pages", "800", "--host-cache-memory", str(256 << 20)],
}


def _records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "requests.jsonl").read_text().splitlines() if line]


def _last_turn_ttft(records: list[dict]) -> float | None:
    by_session: dict[str, dict] = {}
    for r in records:
        if r["status"] != "ok" or r["phase"] != "profiling" or r["first_token_time"] is None:
            continue
        cur = by_session.get(r["session_id"])
        if cur is None or r["turn_index"] > cur["turn_index"]:
            by_session[r["session_id"]] = r
    vals = [r["first_token_time"] - r["send_time"] for r in by_session.values()]
    return statistics.mean(vals) if vals else None


def _bench(url: str, out: Path, workload: str, sessions: int, seed: int) -> dict:
    kw = dict(base_url=url, output_dir=str(out), workload=workload, concurrency=[1], num_sessions=sessions,
              seed=seed, progress=False, telemetry=False, argv=["benchmarks/prefix_cache.py"])
    if workload == "agentic":
        kw["scale"] = "medium"
    else:
        kw["multiturn"] = MultiTurnSpec(turns=8, shared_prefix_tokens=512, first_user_tokens=1024,
                                        user_tokens_per_turn=1000, output_tokens=(16, 32), think_mean_s=0.0)
    (_, summary, run_dir), = run_bench(BenchConfig(**kw))
    recs = _records(Path(run_dir))
    cache = summary.get("cache", {})
    prompt = [r["input_tokens"] for r in recs if r["status"] == "ok" and r["input_tokens"]]
    return {
        "ttft_mean_s": summary["ttft_s"]["mean"], "ttft_p90_s": summary["ttft_s"]["p90"],
        "last_turn_ttft_s": _last_turn_ttft(recs),
        "task_latency_mean_s": summary["task_latency_s"]["mean"],
        "task_latency_p90_s": summary["task_latency_s"]["p90"],
        "requests": len(recs), "max_prompt_tokens": max(prompt) if prompt else 0,
        "hit_rate_server": cache.get("prefix_cache_hit_rate"),
        "hit_rate_theoretical": cache.get("prefix_cache_hit_rate_theoretical"),
        "hit_vs_theoretical": cache.get("prefix_cache_hit_vs_theoretical"),
    }


def _server_card(url: str) -> dict:
    import httpx
    return httpx.get(url + "/v1/models", timeout=10).json()["data"][0]["flashlane"]


def _scrape(url: str, name: str) -> float:
    import httpx
    total = 0.0
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        if line.startswith(name):
            total += float(line.rsplit(" ", 1)[1])
    return total


def host_hit_vs_recompute(model: str, tokens: int, repeats: int) -> dict:
    """In-process: TTFT of a prompt whose prefix is recomputed vs loaded back from the host tier."""
    from flashlane import LLM, SamplingParams

    params = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    pages = tokens // 16 + 8
    llm = LLM(model, dtype="float32", num_pages=pages, host_cache_memory=512 << 20, num_threads=2)
    plain = LLM(model, dtype="float32", enable_prefix_caching=False, num_threads=2)
    vocab = min(llm.engine.config.vocab_size, 4000)
    cold, warm, cached = [], [], []
    for i in range(repeats):
        prompt = [(7 * i + 13 * j) % (vocab - 10) + 10 for j in range(tokens)]
        filler = [(11 * i + 5 * j) % (vocab - 10) + 10 for j in range(tokens)]
        t = time.perf_counter()
        plain.generate([prompt], params)
        cold.append(time.perf_counter() - t)
        llm.generate([prompt], params)               # caches it ...
        llm.generate([filler], params)               # ... and pushes it out of the pool to the host tier
        before = llm.engine.stats()["prefix_cache_hits_host"]
        t = time.perf_counter()
        out = llm.generate([prompt], params)[0]
        warm.append(time.perf_counter() - t)
        cached.append(out.num_cached_tokens)
        assert llm.engine.stats()["prefix_cache_hits_host"] > before, "the hit did not come from the host tier"
    return {"prompt_tokens": tokens, "recompute_s": statistics.median(cold), "host_hit_s": statistics.median(warm),
            "speedup": statistics.median(cold) / statistics.median(warm), "cached_tokens": cached}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--out")
    args = ap.parse_args()
    sessions = {"agentic": 2 if args.quick else 4, "multiturn": 1 if args.quick else 2}
    results: dict = {"workloads": {}, "host_tier": {}}
    with tempfile.TemporaryDirectory() as tmp:
        for model in args.models.split(","):
            for name, flags in CONFIGS.items():
                port = free_port()
                url = f"http://127.0.0.1:{port}"
                cmd = serve_command(model, port, extra_args=COMMON + flags)
                with ServerProcess(cmd, url, Path(tmp) / f"{model}-{name}.log"):
                    card = _server_card(url)
                    for workload, n in sessions.items():
                        row = _bench(url, Path(tmp) / f"{model}-{name}-{workload}", workload, n, seed=3)
                        row["bytes_per_checkpoint"] = card.get("bytes_per_checkpoint", 0)
                        results["workloads"].setdefault(model, {}).setdefault(workload, {})[name] = row
                        print(model, name, workload, json.dumps(row), flush=True)
                    results["workloads"][model]["host_hits_tokens_" + name] = _scrape(
                        url, 'flashlane:prefix_cache_hits_by_tier_total{model_name="%s",tier="host"}' % model)
            results["host_tier"][model] = host_hit_vs_recompute(model, 2048, 3)
            print(model, "host tier", json.dumps(results["host_tier"][model]), flush=True)
    for model, per in results["workloads"].items():
        long = per["multiturn"]
        off, on = long["off"]["last_turn_ttft_s"], long["on"]["last_turn_ttft_s"]
        per["last_turn_ttft_speedup"] = off / on if off and on else None
    write_result("prefix_cache", results, args.out)


if __name__ == "__main__":
    main()
