"""Converters from summary.json to other tools' key conventions, for cross-tool comparison."""

from __future__ import annotations

_VLLM_BLOCKS = {"ttft": "ttft_s", "tpot": "tpot_s", "itl": "itl_s", "e2el": "e2e_s"}


def to_vllm_flat(s: dict) -> dict:
    """vLLM `bench serve` style flat keys (milliseconds)."""
    tp = s["throughput"]
    out = {"completed": s["requests"]["completed"], "failed": s["requests"]["failed"],
           "duration": tp["duration_s"], "total_input_tokens": tp["input_tokens"],
           "total_output_tokens": tp["output_tokens"], "request_throughput": tp["requests_per_s"],
           "output_throughput": tp["output_tok_s"], "total_token_throughput": tp["total_tok_s"],
           "max_concurrency": s["load_point"].get("concurrency"),
           "request_rate": s["load_point"].get("request_rate")}
    if s["goodput"].get("slo"):
        out["request_goodput"] = s["goodput"]["requests_per_s"]
    for short, key in _VLLM_BLOCKS.items():
        b = s[key]
        for stat in ("mean", "std", "p50", "p90", "p95", "p99"):
            name = {"p50": "median"}.get(stat, stat)
            v = b.get(stat)
            out[f"{name}_{short}_ms"] = v * 1000.0 if v is not None else None
    return out


def to_inferencex(s: dict, num_gpus: int = 1) -> dict:
    """InferenceX agentic aggregate keys (nested)."""
    def lat(key, scale=1.0):
        b = s[key]
        return {k: (b[k] * scale if b.get(k) is not None else None)
                for k in ("mean", "std", "p50", "p75", "p90", "p95", "p99")}

    intvty = {k: v for k, v in s["interactivity_from_tpot"].items()}
    return {
        "request_metrics": {"latency": {"ttft": lat("ttft_s"), "e2el": lat("e2e_s"),
                                        "itl": lat("itl_s"), "tpot": lat("tpot_s"),
                                        "intvty": intvty}},
        "throughput": {"per_gpu": {"total_tput_tps": s["throughput"]["total_tok_s"] / num_gpus,
                                   "output_tput_tps": s["throughput"]["output_tok_s"] / num_gpus}},
        "cache": {"theoretical_cache_hit_rate": s["cache"]["theoretical_hit_rate"]},
        "server_metrics": {"cache": {"observed_hit_rate": s["cache"]["prefix_cache_hit_rate"]}},
        "request_accounting": {"completed": s["requests"]["completed"],
                               "error_request_count": s["requests"]["failed"]},
    }
