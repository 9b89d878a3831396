"""`flashlane bench`: benchmark any OpenAI-compatible server over HTTP."""

from __future__ import annotations

import sys
import time

from .bench_args import add_common, base_url, common_kwargs, float_list, int_list, int_pair, positive_int
from .help import HelpFormatter


def add_parser(subparsers):
    p = subparsers.add_parser("bench", help="benchmark an OpenAI-compatible server (HTTP only)",
                              description=__doc__, formatter_class=HelpFormatter)
    p.add_argument("--base-url", required=True, type=base_url, help="the server, e.g. http://127.0.0.1:8000")
    p.add_argument("--model", default=None, help="served model name (default: first in /v1/models)")
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
    p.add_argument("--output-dir", default=None, help="results folder (default: flashlane-bench-<time>)")
    p.add_argument("--server-pid", type=int, default=None,
                   help="server PID for CPU/RSS telemetry (default: found from the port when local)")
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
    add_common(p)
    p.set_defaults(func=run)
    return p


def run(args) -> int:
    from flashlane.bench.report_md import md_table
    from flashlane.bench.report_rows import sweep_rows
    from flashlane.bench.replay import BenchAbort
    from flashlane.bench.runner import BenchConfig, run_bench
    from flashlane.bench.workloads.fixed import FixedSpec
    from flashlane.bench.workloads.multiturn import MultiTurnSpec

    output_dir = args.output_dir or time.strftime("flashlane-bench-%Y%m%d-%H%M%S")
    kw = common_kwargs(args)
    if args.workload == "fixed":
        if args.num_sessions is not None:
            print("bench: error: --workload fixed counts requests: use --num-requests (or --num-prompts), "
                  "not --num-sessions", file=sys.stderr)
            return 2
        kw["num_sessions"] = args.num_requests
    elif args.num_requests is not None:
        print(f"bench: error: --num-requests counts requests of --workload fixed; --workload {args.workload} "
              f"counts sessions with --num-sessions", file=sys.stderr)
        return 2
    try:
        cfg = BenchConfig(
            base_url=args.base_url, output_dir=output_dir, model=args.model,
            workload=args.workload, trace=args.trace, scale=args.scale,
            concurrency=args.concurrency or (None if args.request_rate else [1]),
            request_rates=args.request_rate, burstiness=args.burstiness,
            max_concurrency=args.max_concurrency, server_pid=args.server_pid,
            fixed=FixedSpec(args.input_len, args.output_len, args.range_ratio),
            multiturn=MultiTurnSpec(turns=args.turns, shared_prefix_tokens=args.shared_prefix,
                                    first_user_tokens=args.first_user_tokens,
                                    user_tokens_per_turn=args.user_tokens_per_turn,
                                    output_tokens=args.mt_output_len, think=args.think_dist,
                                    think_mean_s=args.think_mean),
            **kw)
        from .. import presets
        results = run_bench(cfg, resolve_tokenizer=presets.tokenizer_file)
    except KeyboardInterrupt:
        print("bench: interrupted; partial results were written", file=sys.stderr)
        return 130
    except BenchAbort as e:
        print(f"bench: aborted: {e} (partial results were written)", file=sys.stderr)
        return 1
    except (ValueError, OSError) as e:
        print(f"bench: error: {e}", file=sys.stderr)
        return 2
    head, rows = sweep_rows([(p.label, s) for p, s, _ in results])
    print(md_table(head, rows))
    for p, s, d in results:
        if not s["validity"]["valid"]:
            print(f"{p.label}: INVALID: {'; '.join(s['validity']['reasons'])}", file=sys.stderr)
    print(f"results: {output_dir}")
    from .record import record_results
    record_results(args, "bench", output_dir)
    return 0
