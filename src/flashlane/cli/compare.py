"""`flashlane compare [A B]`: the same seeded agentic workload on two targets, side by side.

With no arguments it runs tiny-flash (hybrid) and tiny-standard under three serving stacks
(naive static batching, hybrid-cache-gap, flashlane: see --stacks), each (stack, model) its own
`flashlane serve` on a free port, on the long agentic workload (contexts past 8K tokens) at
concurrency 1, and prints the answer first: which stack makes the hybrid slower per task, by how
much (paired 95% CI over tasks), where the time goes (measured; and the same rounds replayed by
the simulator beside each side, with its errors and a counterfactual waterfall) and which stack
closes the gap; writes compare.md,
compare.json and report.html and stops every server. A and B may be model ids (started here) or
base URLs (used as given: then no stacks). Servers started here run under equal conditions: dtype
"auto" and the thread count are resolved once, here, and both get the same --dtype and
--num-threads (unless given with --serve-arg).
"""

from __future__ import annotations

import os
import sys
import time

from .bench_args import add_common, common_kwargs, int_list, positive_int
from .help import HelpFormatter

# Sessions per load point (a * concurrency + b), by scale: a p90 is meaningful, yet the default
# sweep finishes in a few minutes on 2 CPU cores and `small` fits CI.
SESSIONS_PER_LOAD = {"small": (1, 1), "medium": (1, 2), "long": (4, 0), "large": (4, 4), "full": (8, 0)}
# `long` (the default) measures 4 whole tasks per (stack, model) at concurrency 1, in 4 paired
# rounds: with 3 the t quantile (4.3) alone made the CI ±15% at a 6% per-task spread; 4 (3.2)
# keeps the hybrid-cache-gap CI within ±15% on an idle machine (benchmarks/compare_under_load.py;
# --num-sessions N for a tighter one). The naive stack, no cache for either, is about 60% of the run.
DEFAULT_CONCURRENCY = {"long": [1]}


def _given(serve_args: list[str], flag: str) -> str | None:
    """The value `flag` gets from the --serve-arg tokens (the last one, as argparse takes it);
    None when it is not there."""
    value = None
    for i, tok in enumerate(serve_args):
        if tok == flag:
            value = serve_args[i + 1] if i + 1 < len(serve_args) else ""
        elif tok.startswith(flag + "="):
            value = tok[len(flag) + 1:]
    return value


def _fresh_server_threads() -> int:
    """The torch threads a `flashlane serve` started now would take (engine.threads.choose_threads
    in a process that has not loaded torch; this one may have: then its count says nothing)."""
    from ..engine.threads import busy_cpus, choose_threads, default_threads, usable_cpus

    choice = choose_threads(None)
    if choice.set_here:
        return choice.threads
    omp = os.environ.get("OMP_NUM_THREADS", "").split(",")[0].strip()
    if omp.isdigit() and int(omp) > 0:
        return int(omp)
    cpus = usable_cpus()
    return default_threads(len(cpus), busy_cpus(cpus))


def _auto_dtype(threads: int):
    """dtype "auto" as a server would resolve it: timed with the servers' thread count."""
    import torch

    from ..models.loader import auto_cpu_dtype_choice

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return auto_cpu_dtype_choice()
    finally:
        torch.set_num_threads(before)


def _auto_linear_kernel(dtype: str, threads: int):
    """linear_kernel "auto" as a server would resolve it: timed with the servers' thread count."""
    import torch

    from ..kernels.linear_plan import choose_linear_plan

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return choose_linear_plan("auto", getattr(torch, dtype))
    finally:
        torch.set_num_threads(before)


def equal_conditions(serve_args: list[str], log) -> tuple[list[str], dict]:
    """Resolve dtype "auto", the float linears' format "auto" and the thread count once, here, for
    both servers: left to each server they follow its own start-up timing and load, and the two
    servers of one comparison could run different dtypes or weight formats. Values given with
    --serve-arg are kept (an explicit `auto` is resolved here too, with the same meaning). Returns
    (args to append, conditions for the report)."""
    dtype, threads = _given(serve_args, "--dtype"), _given(serve_args, "--num-threads")
    extra: list[str] = []
    if threads is None:
        threads = str(_fresh_server_threads())   # before this process loads torch, if it has not
        extra += ["--num-threads", threads]
    num_threads = int(threads) if threads.isdigit() else threads
    reason = "given with --serve-arg"
    if dtype in (None, "auto"):
        choice = _auto_dtype(num_threads if isinstance(num_threads, int) and num_threads > 0 else 1)
        dtype, reason = choice.dtype, choice.why
        extra = ["--dtype", dtype] + extra
    linear, linear_reason = _given(serve_args, "--linear-kernel"), "given with --serve-arg"
    if linear in (None, "auto"):
        n = num_threads if isinstance(num_threads, int) and num_threads > 0 else 1
        plan = _auto_linear_kernel(dtype, n)
        linear, linear_reason = plan.format, plan.why
        extra += ["--linear-kernel", linear]
    log(f"both servers: dtype {dtype} ({'auto: ' + reason if '--dtype' in extra else reason}), "
        f"{num_threads} thread{'' if num_threads == 1 else 's'}, linears {linear}")
    return extra, {"dtype": dtype, "dtype_reason": reason, "num_threads": num_threads,
                   "linear_kernel": linear, "linear_kernel_reason": linear_reason,
                   "source": "resolved once by compare" if extra else "given with --serve-arg"}


def add_parser(subparsers):
    p = subparsers.add_parser("compare", help="compare two models or servers on the same workload",
                              description=__doc__, formatter_class=HelpFormatter)
    p.add_argument("a", nargs="?", default="tiny-flash", help="model id or base URL (default tiny-flash)")
    p.add_argument("b", nargs="?", default="tiny-standard",
                   help="model id or base URL (default tiny-standard)")
    p.add_argument("--concurrency", type=int_list, default=None,
                   help="closed-loop concurrency sweep (default: 1 at --scale long, else 1,2,4)")
    p.add_argument("--scale", choices=("small", "medium", "long", "large", "full"), default=None,
                   help="size of the synthetic agentic sessions and sessions per load point; long (the default): "
                        "10-11 turns growing past 8K tokens, whole tasks from turn 0 (no t* warmup); large (the "
                        "default with --simulate): 8-30 turns up to 131K tokens; full: AgentX-like sessions of "
                        "20-80 turns up to 262K tokens (--simulate: about 20 s per simulated task)")
    p.add_argument("--stacks", default=None,
                   help="serving stacks to run each model under, comma-separated: naive, "
                        "hybrid-cache-gap, flashlane, or one a --stacks-file defines (default: all "
                        "three, or the --stacks-file stacks; with --serve-command or URL targets: "
                        "none, the servers as given)")
    p.add_argument("--stacks-file", action="append", default=[], metavar="PATH",
                   help="a stack file (TOML: per role a server command, env and mechanisms; see "
                        "examples/stacks/) or a folder of them (repeatable); adds stacks or overrides "
                        "built-ins of the same name; without --stacks, the stacks of these files run, "
                        "in order. A command other than `flashlane serve` (vLLM, SGLang) is started "
                        "as written; only wall-clock figures are measured for it")
    p.add_argument("--no-simulate", "--no-predict", dest="no_simulate", action="store_true",
                   help="skip the simulation beside each measured side (and the step-cost calibration it may "
                        "need), the counterfactual waterfall and the profile")
    p.add_argument("--calibration-grid", choices=("compare", "quick"), default="compare",
                   help="the `flashlane calibrate` grid run for a model whose step costs on this machine and "
                        "engine mode are not cached yet ($FLASHLANE_CACHE/calibrations): compare (prompts up to 8K, "
                        "2-4 min per tiny preset on 2 cores) or quick (a smoke run, a poorer fit)")
    p.add_argument("--no-profile", action="store_true",
                   help="skip the per-layer-type `flashlane profile` of each model (1-3 min at 8K "
                        "context on 2 CPU cores)")
    p.add_argument("--trace", default=None,
                   help="replay this trace file instead of synthetic sessions (default: synthetic)")
    p.add_argument("--output-dir", default=None, help="default: flashlane-compare-<time>")
    g = p.add_argument_group("the whole study in simulation (full-size models on GPUs)")
    g.add_argument("--simulate", action="store_true",
                   help="run no server: simulate both models under every stack on --hardware (the engine's "
                        "scheduler and cache manager, step costs from the hardware profile), print per-task "
                        "latency, tasks/h and p90 beside the public finding's, every assumption, and which one "
                        "moves the ratio most")
    g.add_argument("--hardware", default=None, metavar="NAMExN", help="with --simulate: e.g. h200x8")
    g.add_argument("--tp", type=positive_int, default=None, help="with --simulate: tensor parallel (default: all GPUs)")
    g.add_argument("--ep", type=positive_int, default=None, help="with --simulate: expert parallel (default: all GPUs)")
    g.add_argument("--weight-dtype", choices=("bf16", "fp8"), default="fp8", help="with --simulate: weight dtype")
    p.add_argument("--serve-command", default=None,
                   help="server command template with {model} {port} {host} {python}; "
                        "default: flashlane serve --model {model} --host 127.0.0.1 --port {port}")
    p.add_argument("--serve-arg", action="append", default=[],
                   help="extra engine argument passed to both servers (repeatable; default: none); "
                        "without --dtype / --num-threads here, both servers get the ones compare resolves "
                        "once (dtype auto, the CPUs not busy less one)")
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
    from flashlane.bench.stack_files import load_stack_paths
    from flashlane.bench.stacks import ROLES, STACKS, parse_stacks

    if args.a == args.b:
        print("flashlane compare: error: A and B are the same target", file=sys.stderr)
        return 2
    if args.simulate:
        return run_simulated(args)
    if args.hardware or args.tp or args.ep:
        print("flashlane compare: error: --hardware / --tp / --ep are for --simulate", file=sys.stderr)
        return 2
    args.scale = args.scale or "long"
    try:
        files = load_stack_paths(args.stacks_file) if args.stacks_file else {}
        # a custom --serve-command gets stack flags only when stacks are asked for explicitly
        asked = bool(args.stacks or files)
        stacks = (parse_stacks(args.stacks, {**STACKS, **files}, default=list(files) or None)
                  if asked or not args.serve_command else None)
    except ValueError as e:
        print(f"flashlane compare: error: {e}", file=sys.stderr)
        return 2
    if stacks and any(t.startswith(("http://", "https://")) for t in (args.a, args.b)):
        print("flashlane compare: URL targets cannot take stacks; only the given servers run",
              file=sys.stderr)
        stacks = None
    # servers started here that are `flashlane serve` (equal conditions, local prediction and profile)
    local_engine = not stacks or any(not s.external(r) for s in stacks for r in ROLES)
    if stacks and (args.serve_command or args.serve_arg) and any(s.external(r) for s in stacks for r in ROLES):
        print("flashlane compare: --serve-command / --serve-arg apply to `flashlane serve` stacks only; "
              "external stack commands run as written", file=sys.stderr)
    out = Path(args.output_dir or time.strftime("flashlane-compare-%Y%m%d-%H%M%S"))
    kw = common_kwargs(args)
    if args.scale == "long" and kw["warmup"] == "auto":
        # whole tasks from turn 0 (per-task latency of every task run), after a few single
        # requests that pay each server's first-call costs outside the measured tasks
        kw["warmup"] = "requests"
    log = (lambda m: print(m, file=sys.stderr)) if not args.no_progress else (lambda m: None)
    try:
        cfg = BenchConfig(base_url="http://unset", output_dir=str(out), workload="agentic",
                          trace=args.trace, scale=args.scale,
                          concurrency=args.concurrency or DEFAULT_CONCURRENCY.get(args.scale, [1, 2, 4]),
                          sessions_per_load=SESSIONS_PER_LOAD[args.scale], **kw)
        extra_args, conditions = list(args.serve_arg), None
        if (not args.serve_command and local_engine
                and not any(t.startswith(("http://", "https://")) for t in (args.a, args.b))):
            more, conditions = equal_conditions(extra_args, log)
            extra_args += more
        from .. import presets
        from . import compare_attribution as attr
        simulator = profile = None
        if not local_engine and not args.no_simulate:
            log("compare: every stack runs an external server; no simulation beside it, no profile")
        if not args.no_simulate and local_engine:
            if args.serve_command:
                log("compare: --serve-command servers are not `flashlane serve` as the simulator knows it; "
                    "no simulation beside them")
            else:
                from .compare_simulation import LocalSimulator
                simulator = LocalSimulator(extra_args, out, log=log, grid=args.calibration_grid,
                                           max_batch=max(cfg.concurrency))
            profile = None if args.no_profile else attr.make_profiler(out, log=log)
        res = run_compare(args.a, args.b, cfg, out, template=args.serve_command,
                          extra_args=extra_args, startup_timeout_s=args.startup_timeout, log=log,
                          resolve_tokenizer=presets.tokenizer_file, stacks=stacks, role_of=attr.role_of,
                          simulator=simulator, profile=profile, conditions=conditions)
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


SIMULATED_SESSIONS = 4     # tasks per (stack, model) with --simulate (each side is deterministic)


def run_simulated(args) -> int:
    """compare --simulate: the study on simulated servers (cli/compare_study.py)."""
    from pathlib import Path

    from ..bench.stack_files import load_stack_paths
    from ..bench.stacks import STACKS, parse_stacks
    from ..config import ConfigError
    from ..simulate.run import sim_bench_config
    from .compare_study import run_study

    if not args.hardware:
        print("flashlane compare: error: --simulate needs --hardware (e.g. h200x8); on this machine, measure "
              "instead (the simulation then runs beside each measured side)", file=sys.stderr)
        return 2
    if args.concurrency and len(args.concurrency) > 1:
        print("flashlane compare: error: --simulate studies one load point: give one --concurrency (run again "
              "for another)", file=sys.stderr)
        return 2
    log = (lambda m: print(m, file=sys.stderr)) if not args.no_progress else (lambda m: None)
    scale = args.scale or "large"
    out = Path(args.output_dir or time.strftime("flashlane-compare-%Y%m%d-%H%M%S"))
    try:
        files = load_stack_paths(args.stacks_file) if args.stacks_file else {}
        stacks = parse_stacks(args.stacks, {**STACKS, **files}, default=list(files) or None)
        kw = common_kwargs(args)
        kw["num_sessions"] = kw["num_sessions"] or SIMULATED_SESSIONS
        if kw["warmup"] == "auto":
            kw["warmup"] = "none"          # whole tasks from turn 0; a simulated server has no first-call cost
        cfg = sim_bench_config(output_dir=str(out), workload="agentic", trace=args.trace, scale=scale,
                               concurrency=args.concurrency or [1], **kw)
        res = run_study(args.a, args.b, stacks, args.hardware, args.tp, args.ep, args.weight_dtype, cfg, out, log)
    except KeyboardInterrupt:
        print("flashlane compare: interrupted", file=sys.stderr)
        return 130
    except (ValueError, ConfigError, OSError) as e:
        print(f"flashlane compare: error: {e}", file=sys.stderr)
        return 2
    print(res["markdown"])
    print(f"simulated study: {out / 'compare.md'}")
    return 0
