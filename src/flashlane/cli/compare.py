"""`flashlane compare [A B]`: the same seeded agentic workload on two targets, side by side.

With no arguments it runs tiny-flash (hybrid) and tiny-standard under three serving stacks
(naive static batching, hybrid-cache-gap, flashlane: see --stacks), each (stack, model) its own
`flashlane serve` on a free port, on the long agentic workload (contexts past 8K tokens) at
concurrency 1, and prints the answer first: which stack makes the hybrid slower per task, by how
much (bootstrap 95% CI over tasks), what the time goes to (analyze's prediction on this machine's
calibrated profile beside the measurement) and which stack closes the gap; writes compare.md,
compare.json and report.html and stops every server. A and B may be model ids (started here) or
base URLs (used as given: then no stacks).
"""

from __future__ import annotations

import sys
import time

from .bench_args import add_common, common_kwargs, int_list
from .help import HelpFormatter

# Sessions per load point (a * concurrency + b), by scale: a p90 is meaningful, yet the default
# sweep finishes in a few minutes on 2 CPU cores and `small` fits CI.
SESSIONS_PER_LOAD = {"small": (1, 1), "medium": (1, 2), "long": (3, 0), "large": (4, 4), "full": (8, 0)}
# `long` (the default) measures 3 whole tasks per (stack, model) at concurrency 1 (enough for a
# bootstrap CI of the ratio; --num-sessions N for a tighter one): estimated 12-13 min for the three
# stacks on 2 idle CPU cores from one-task measurements (tiny-flash without a prefix cache ~40 s a
# task, tiny-standard ~2x that; the naive stack, no cache for either, is about 60% of the run).
DEFAULT_CONCURRENCY = {"long": [1]}


def add_parser(subparsers):
    p = subparsers.add_parser("compare", help="compare two models or servers on the same workload",
                              description=__doc__, formatter_class=HelpFormatter)
    p.add_argument("a", nargs="?", default="tiny-flash", help="model id or base URL (default tiny-flash)")
    p.add_argument("b", nargs="?", default="tiny-standard",
                   help="model id or base URL (default tiny-standard)")
    p.add_argument("--concurrency", type=int_list, default=None,
                   help="closed-loop concurrency sweep (default: 1 at --scale long, else 1,2,4)")
    p.add_argument("--scale", choices=("small", "medium", "long", "large", "full"), default="long",
                   help="size of the synthetic agentic sessions and sessions per load point; long: "
                        "10-11 turns growing past 8K tokens, whole tasks from turn 0 (no t* warmup)")
    p.add_argument("--stacks", default=None,
                   help="serving stacks to run each model under, comma-separated: naive, "
                        "hybrid-cache-gap, flashlane (default: all three; with --serve-command or "
                        "URL targets: none, the servers as given)")
    p.add_argument("--no-predict", action="store_true",
                   help="skip the local hardware calibration, analyze's prediction and the profile")
    p.add_argument("--no-profile", action="store_true",
                   help="skip the per-layer-type `flashlane profile` of each model (1-3 min at 8K "
                        "context on 2 CPU cores)")
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

    from flashlane.bench.stacks import parse_stacks

    if args.a == args.b:
        print("flashlane compare: error: A and B are the same target", file=sys.stderr)
        return 2
    try:
        # a custom --serve-command gets stack flags only when --stacks is asked for explicitly
        stacks = parse_stacks(args.stacks) if args.stacks or not args.serve_command else None
    except ValueError as e:
        print(f"flashlane compare: error: {e}", file=sys.stderr)
        return 2
    if stacks and any(t.startswith(("http://", "https://")) for t in (args.a, args.b)):
        print("flashlane compare: URL targets cannot take stacks; only the given servers run",
              file=sys.stderr)
        stacks = None
    out = Path(args.output_dir or time.strftime("flashlane-compare-%Y%m%d-%H%M%S"))
    kw = common_kwargs(args)
    if args.scale == "long" and kw["warmup"] == "auto":
        kw["warmup"] = "none"  # whole tasks from turn 0: per-task latency of every task run
    log = (lambda m: print(m, file=sys.stderr)) if not args.no_progress else (lambda m: None)
    try:
        cfg = BenchConfig(base_url="http://unset", output_dir=str(out), workload="agentic",
                          trace=args.trace, scale=args.scale,
                          concurrency=args.concurrency or DEFAULT_CONCURRENCY.get(args.scale, [1, 2, 4]),
                          sessions_per_load=SESSIONS_PER_LOAD[args.scale], **kw)
        from .. import presets
        from . import compare_attribution as attr
        predict = profile = hardware = None
        if not args.no_predict:
            from ..analyze.hardware import calibrate_local
            local = calibrate_local()
            hardware = local.to_dict()
            predict = attr.make_predictor(local)
            profile = None if args.no_profile else attr.make_profiler(out, log=log)
        res = run_compare(args.a, args.b, cfg, out, template=args.serve_command,
                          extra_args=args.serve_arg, startup_timeout_s=args.startup_timeout, log=log,
                          resolve_tokenizer=presets.tokenizer_file, stacks=stacks, role_of=attr.role_of,
                          predict=predict, profile=profile, hardware=hardware)
    except KeyboardInterrupt:
        print("flashlane compare: interrupted; servers stopped, partial results kept", file=sys.stderr)
        return 130
    except ServerStartError as e:
        print(f"flashlane compare: error: {e}", file=sys.stderr)
        return 1
    except BenchAbort as e:
        print(f"flashlane compare: aborted: {e} (partial results were written)", file=sys.stderr)
        return 1
    except (ValueError, OSError) as e:
        print(f"flashlane compare: error: {e}", file=sys.stderr)
        return 2
    print(res["markdown"])
    print(f"{res['tasks_measured']} tasks measured; report: {out / 'report.html'}")
    from .record import record_results
    record_results(args, "compare", out)
    return 0
