"""`flashlane compare [A B]`: the same seeded agentic workload on two targets, side by side.

With no arguments it starts `flashlane serve --model tiny-flash` and `--model tiny-standard` on
free ports, sweeps concurrency 1,2,4, prints the table with ratios and an explanation, writes
an HTML report, and stops the servers. A and B may be model ids (started here) or base URLs.
"""

from __future__ import annotations

import sys
import time

from .bench_args import add_common, common_kwargs, int_list
from .help import HelpFormatter

# Sessions per load point (a * concurrency + b), by scale: a p90 is meaningful, yet the default
# sweep finishes in a few minutes on 2 CPU cores and `small` fits CI.
SESSIONS_PER_LOAD = {"small": (1, 1), "medium": (1, 2), "large": (4, 4), "full": (8, 0)}


def add_parser(subparsers):
    p = subparsers.add_parser("compare", help="compare two models or servers on the same workload",
                              description=__doc__, formatter_class=HelpFormatter)
    p.add_argument("a", nargs="?", default="tiny-flash", help="model id or base URL (default tiny-flash)")
    p.add_argument("b", nargs="?", default="tiny-standard",
                   help="model id or base URL (default tiny-standard)")
    p.add_argument("--concurrency", type=int_list, default=[1, 2, 4], help="closed-loop concurrency sweep")
    p.add_argument("--scale", choices=("small", "medium", "large", "full"), default="medium",
                   help="size of the synthetic agentic sessions and sessions per load point")
    p.add_argument("--trace", default=None,
                   help="replay this trace file instead of synthetic sessions (default: synthetic)")
    p.add_argument("--output-dir", default=None, help="default: flashlane-compare-<time>")
    p.add_argument("--serve-command", default=None,
                   help="server command template with {model} {port} {host} {python}; "
                        "default: flashlane serve --model {model} --host 127.0.0.1 --port {port}")
    p.add_argument("--serve-arg", action="append", default=[],
                   help="extra engine argument passed to both servers (repeatable; default: none)")
    p.add_argument("--startup-timeout", type=float, default=600.0,
                   help="seconds a started server may take to answer /health")
    add_common(p)
    p.set_defaults(func=run)
    return p


def run(args) -> int:
    from pathlib import Path

    from flashlane.bench.compare import run_compare
    from flashlane.bench.replay import BenchAbort
    from flashlane.bench.runner import BenchConfig
    from flashlane.bench.server_launch import ServerStartError

    if args.a == args.b:
        print("compare: error: A and B are the same target", file=sys.stderr)
        return 2
    out = Path(args.output_dir or time.strftime("flashlane-compare-%Y%m%d-%H%M%S"))
    kw = common_kwargs(args)
    log = (lambda m: print(m, file=sys.stderr)) if not args.no_progress else (lambda m: None)
    try:
        cfg = BenchConfig(base_url="http://unset", output_dir=str(out), workload="agentic",
                          trace=args.trace, scale=args.scale, concurrency=args.concurrency,
                          sessions_per_load=SESSIONS_PER_LOAD[args.scale], **kw)
        from .. import presets
        res = run_compare(args.a, args.b, cfg, out, template=args.serve_command,
                          extra_args=args.serve_arg, startup_timeout_s=args.startup_timeout, log=log,
                          resolve_tokenizer=presets.tokenizer_file)
    except KeyboardInterrupt:
        print("compare: interrupted; servers stopped, partial results kept", file=sys.stderr)
        return 130
    except ServerStartError as e:
        print(f"compare: error: {e}", file=sys.stderr)
        return 1
    except BenchAbort as e:
        print(f"compare: aborted: {e} (partial results were written)", file=sys.stderr)
        return 1
    except (ValueError, OSError) as e:
        print(f"compare: error: {e}", file=sys.stderr)
        return 2
    print(res["markdown"])
    print(f"report: {out / 'report.html'}")
    return 0
