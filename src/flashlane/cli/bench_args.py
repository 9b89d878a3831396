"""Argument parsing shared by `flashlane bench` and `flashlane compare`."""

from __future__ import annotations

import argparse


def base_url(text: str) -> str:
    if not text.lower().startswith(("http://", "https://")):
        raise argparse.ArgumentTypeError(f"base URL must start with http:// or https://, got {text!r}")
    return text


def positive_int(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}") from None
    if v < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}")
    return v


def int_list(text: str) -> list[int]:
    try:
        vals = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not vals or any(v < 1 for v in vals):
        raise argparse.ArgumentTypeError(f"expected integers >= 1, got {text!r}")
    return vals


def float_list(text: str) -> list[float]:
    try:
        vals = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}") from None
    if not vals or any(not v > 0 for v in vals):
        raise argparse.ArgumentTypeError(f"expected numbers > 0, got {text!r}")
    return vals


def int_pair(text: str) -> tuple[int, int]:
    parts = text.split(",")
    try:
        lo, hi = (int(parts[0]), int(parts[-1]))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected N or LO,HI, got {text!r}") from None
    if len(parts) > 2 or lo < 1 or hi < lo:
        raise argparse.ArgumentTypeError(f"expected N or LO,HI with 1 <= LO <= HI, got {text!r}")
    return lo, hi


def slo_dict(text: str) -> dict:
    """'ttft=2,tpot=0.1,e2e=30' (seconds) -> {'ttft_s': 2.0, ...}."""
    out = {}
    for part in text.split(","):
        if not part.strip():
            continue
        k, _, v = part.partition("=")
        k = k.strip().removesuffix("_s")
        if k not in ("ttft", "tpot", "e2e") or not v:
            raise argparse.ArgumentTypeError(f"slo: expected ttft=S,tpot=S,e2e=S, got {part!r}")
        try:
            out[f"{k}_s"] = float(v)
        except ValueError:
            raise argparse.ArgumentTypeError(f"slo: {k} needs a number of seconds, got {v!r}") from None
    return out


def add_common(p: argparse.ArgumentParser) -> None:
    """Options both commands share: workload shape, load, timing, telemetry, output."""
    p.add_argument("--mode", choices=("recorded", "live"), default="recorded",
                   help="recorded: fixed output lengths (ignore_eos); live: the server's own output fed back")
    p.add_argument("--endpoint", choices=("chat", "completions"), default=None,
                   help="default: chat for agentic/multiturn, completions for fixed")
    p.add_argument("--tokenizer", default=None,
                   help="tokenizer.json, a HF folder or a flashlane preset, for exact prompt lengths "
                        "(default: one word ~ one token)")
    p.add_argument("--temperature", type=float, default=None,
                   help="sampling temperature sent with each request (default: not sent, the server's)")
    p.add_argument("--page-size", type=int, default=None,
                   help="server cache page size for the theoretical prefix-cache hit rate "
                        "(default: the flashlane server's /v1/models card, else 16)")
    p.add_argument("--seed", type=int, default=0, help="workload seed (same seed, same sessions and prompts)")
    p.add_argument("--num-sessions", type=int, default=None,
                   help="agentic/multiturn: session trees (tasks) started from turn 0 per load point "
                        "(default: 3 x concurrency, or 10)")
    p.add_argument("--duration", type=float, default=None,
                   help="profiling seconds per load point (default: until the sessions are done)")
    p.add_argument("--warmup", choices=("auto", "none", "tstar", "requests"), default="auto",
                   help="tstar: start sessions mid-timeline (AgentX); requests: discard the first requests; "
                        "auto: tstar for agentic under --concurrency, requests for fixed, else none")
    p.add_argument("--warmup-requests", type=int, default=None,
                   help="requests discarded by --warmup requests (default: 2 x concurrency)")
    p.add_argument("--think-cap", type=float, default=10.0, help="cap on think/tool gaps (s)")
    p.add_argument("--think-scale", type=float, default=1.0, help="multiply think/tool gaps")
    p.add_argument("--slo", type=slo_dict, default={}, help="goodput SLOs, e.g. ttft=2,tpot=0.1,e2e=30")
    p.add_argument("--max-error-rate", type=float, default=0.01,
                   help="a load point with a larger share of failed requests is marked invalid")
    p.add_argument("--request-timeout", type=float, default=600.0, help="seconds before one request is failed")
    p.add_argument("--no-telemetry", action="store_true", help="no /metrics scraping and CPU/GPU sampling")
    p.add_argument("--scrape-interval", type=float, default=1.0, help="seconds between /metrics scrapes")
    p.add_argument("--sample-interval", type=float, default=0.2, help="seconds between CPU/GPU samples")
    p.add_argument("--idle-threshold", type=float, default=0.05,
                   help="utilisation below this counts as idle (idle-gap detection)")
    p.add_argument("--min-gap", type=float, default=0.2, help="shortest idle gap reported (s)")
    p.add_argument("--no-progress", action="store_true", help="no live progress display")
    p.add_argument("--results-db", default=None,
                   help="results store the run is registered in (default: $FLASHLANE_HOME/results.db)")
    p.add_argument("--no-record", action="store_true", help="do not register the run in the results store")


def common_kwargs(args) -> dict:
    return dict(mode=args.mode, endpoint=args.endpoint, tokenizer=args.tokenizer, page_size=args.page_size,
                temperature=args.temperature, seed=args.seed, num_sessions=args.num_sessions,
                duration_s=args.duration, warmup=args.warmup, warmup_requests=args.warmup_requests,
                think_cap_s=args.think_cap, think_scale=args.think_scale, slo=args.slo,
                max_error_rate=args.max_error_rate, request_timeout_s=args.request_timeout,
                telemetry=not args.no_telemetry, scrape_interval_s=args.scrape_interval,
                sample_interval_s=args.sample_interval, idle_threshold=args.idle_threshold,
                min_gap_s=args.min_gap, progress=not args.no_progress)


def add_workload(p: argparse.ArgumentParser) -> None:
    """What is replayed and at which load: `flashlane bench` and `flashlane simulate` alike."""
    p.add_argument("--workload", choices=("agentic", "multiturn", "fixed"), default="agentic",
                   help="agentic session replay, multi-turn chat, or fixed-length requests")
    p.add_argument("--trace", default=None,
                   help="agentic: AgentX / Mooncake / length-only trace file (default: synthetic sessions)")
    p.add_argument("--scale", choices=("small", "medium", "long", "large", "full"), default="medium",
                   help="agentic: size of synthetic sessions")
    load = p.add_mutually_exclusive_group()
    load.add_argument("--concurrency", type=int_list, default=None,
                      help="closed loop, e.g. 1,2,4 (default: 1 unless --request-rate is given)")
    load.add_argument("--request-rate", type=float_list, default=None,
                      help="open loop arrivals/s (sessions for multi-turn workloads), e.g. 0.5,1")
    p.add_argument("--burstiness", type=float, default=1.0, help="gamma shape; 1 = Poisson")
    p.add_argument("--max-concurrency", type=int, default=None,
                   help="open loop: cap on in-flight requests (default: no cap)")
    g = p.add_argument_group("fixed workload")
    g.add_argument("--num-requests", "--num-prompts", dest="num_requests", type=positive_int, default=None,
                   help="requests per load point (vLLM: --num-prompts; default: 10 x concurrency, or 50)")
    g.add_argument("--input-len", type=int, default=1024, help="prompt tokens per request")
    g.add_argument("--output-len", type=int, default=1024, help="output tokens per request")
    g.add_argument("--range-ratio", type=float, default=0.0,
                   help="lengths uniform in [L(1-r), L(1+r)] around --input-len / --output-len")
    g = p.add_argument_group("multiturn workload")
    g.add_argument("--turns", type=int, default=4, help="user turns per conversation")
    g.add_argument("--shared-prefix", type=int, default=256, help="tokens shared by every conversation")
    g.add_argument("--first-user-tokens", type=int, default=64, help="tokens of the first user message")
    g.add_argument("--user-tokens-per-turn", type=int, default=48, help="tokens of each later user message")
    g.add_argument("--mt-output-len", type=int_pair, default=(16, 32), help="output tokens: N or LO,HI")
    g.add_argument("--think-dist", choices=("fixed", "exponential", "uniform"), default="exponential",
                   help="distribution of the user's think time between turns")
    g.add_argument("--think-mean", type=float, default=0.5, help="mean think time (s)")


def workload_kwargs(args) -> dict:
    """BenchConfig's workload and load fields from `add_workload`'s flags; ValueError for a count
    flag that does not fit the workload."""
    from flashlane.bench.workloads.fixed import FixedSpec
    from flashlane.bench.workloads.multiturn import MultiTurnSpec

    num_sessions = args.num_sessions
    if args.workload == "fixed":
        if args.num_sessions is not None:
            raise ValueError("--workload fixed counts requests: use --num-requests (or --num-prompts), "
                             "not --num-sessions")
        num_sessions = args.num_requests
    elif args.num_requests is not None:
        raise ValueError(f"--num-requests counts requests of --workload fixed; --workload {args.workload} "
                         f"counts sessions with --num-sessions")
    return dict(workload=args.workload, trace=args.trace, scale=args.scale,
                concurrency=args.concurrency or (None if args.request_rate else [1]),
                request_rates=args.request_rate, burstiness=args.burstiness,
                max_concurrency=args.max_concurrency, num_sessions=num_sessions,
                fixed=FixedSpec(args.input_len, args.output_len, args.range_ratio),
                multiturn=MultiTurnSpec(turns=args.turns, shared_prefix_tokens=args.shared_prefix,
                                        first_user_tokens=args.first_user_tokens,
                                        user_tokens_per_turn=args.user_tokens_per_turn,
                                        output_tokens=args.mt_output_len, think=args.think_dist,
                                        think_mean_s=args.think_mean))
