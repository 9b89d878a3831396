"""`flashlane bench`: benchmark any OpenAI-compatible server over HTTP."""

from __future__ import annotations

import sys
import time

from .bench_args import add_common, add_workload, base_url, common_kwargs, workload_kwargs
from .help import HelpFormatter


def add_parser(subparsers):
    p = subparsers.add_parser("bench", help="benchmark an OpenAI-compatible server (HTTP only)",
                              description=__doc__, formatter_class=HelpFormatter)
    p.add_argument("--base-url", required=True, type=base_url, help="the server, e.g. http://127.0.0.1:8000")
    p.add_argument("--model", default=None, help="served model name (default: first in /v1/models)")
    add_workload(p)
    p.add_argument("--output-dir", default=None, help="results folder (default: flashlane-bench-<time>)")
    p.add_argument("--server-pid", type=int, default=None,
                   help="server PID for CPU/RSS telemetry (default: found from the port when local)")
    add_common(p)
    p.set_defaults(func=run)
    return p


def run(args) -> int:
    from flashlane.bench.report_md import md_table
    from flashlane.bench.report_rows import sweep_rows
    from flashlane.bench.replay import BenchAbort
    from flashlane.bench.runner import BenchConfig, run_bench

    output_dir = args.output_dir or time.strftime("flashlane-bench-%Y%m%d-%H%M%S")
    try:
        cfg = BenchConfig(base_url=args.base_url, output_dir=output_dir, model=args.model,
                          server_pid=args.server_pid, **{**common_kwargs(args), **workload_kwargs(args)})
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
