"""`flashlane simulate MODEL`: the workload `flashlane bench` would replay, served in simulated time.

The engine's real scheduler and cache manager (prefix cache, state checkpoints, preemption,
static or continuous batching) run with the model forward replaced by a step-cost model: a
calibration of this machine (`flashlane calibrate MODEL`), or named GPUs (`--hardware h200x8`,
stated peaks and efficiencies, `--tp` / `--ep` as communication costs). The simulated server runs
with the flags `flashlane serve` would get (`--serve-arg`, or a stack's, `--stack`), the bench's
own replay talks to it, and the run folder has bench's schema (summary, requests, sessions, the
simulated engine's step records, reports), so `history`, reports and `tune` read it. The
simulation's assumptions are in each manifest under `simulation`.
"""

from __future__ import annotations

import shlex
import sys
import time

from .bench_args import add_common, add_workload, common_kwargs, positive_int, workload_kwargs
from .help import HelpFormatter


def add_parser(subparsers):
    p = subparsers.add_parser("simulate", help="replay a bench workload against MODEL in simulated time",
                              description=__doc__, formatter_class=HelpFormatter)
    p.add_argument("model", help="preset, checkpoint folder, .gguf, or a full-size config (glm-5.3-flash, glm-5.3)")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--calibration", metavar="FILE",
                     help="step costs of MODEL on a CPU, from `flashlane calibrate MODEL` (its engine mode must be "
                          "the simulated server's)")
    src.add_argument("--hardware", metavar="NAMExN",
                     help="named GPUs, e.g. h200x8: step costs from the hardware profile's stated peaks and "
                          "efficiencies (see `flashlane analyze --help` for the profiles)")
    p.add_argument("--tp", type=positive_int, default=None, help="--hardware: tensor-parallel degree (default: all GPUs)")
    p.add_argument("--ep", type=positive_int, default=None,
                   help="--hardware: expert-parallel degree (default: all GPUs; 1: experts sharded tp ways)")
    p.add_argument("--weight-dtype", choices=("bf16", "fp8"), default="fp8", help="--hardware: weight dtype")
    p.add_argument("--stack", default=None,
                   help="run the simulated server as this stack runs MODEL (naive, hybrid-cache-gap, flashlane, or "
                        "one a --stacks-file defines): its flags, or its mechanisms for an external server")
    p.add_argument("--stacks-file", action="append", default=[], metavar="PATH", help="stack files (see compare)")
    p.add_argument("--serve-arg", action="append", default=[],
                   help="a `flashlane serve` engine flag for the simulated server (repeatable; after the stack's), "
                        "e.g. --serve-arg=--max-wait-ms --serve-arg=2")
    p.add_argument("--output-dir", default=None, help="results folder (default: flashlane-simulate-<time>)")
    add_workload(p)
    add_common(p)
    p.set_defaults(func=run)
    return p


def engine_args_for(model_cfg, stack, serve_args: list[str]) -> dict:
    """The engine arguments (those off their default) of the simulated server: the stack's
    `flashlane serve` flags for the model's role (an external stack: its mechanisms), then
    --serve-arg."""
    from ..simulate.setup import is_stateful, mechanism_args
    from .engine_flags import engine_kwargs_of_flags

    defaults = engine_kwargs_of_flags([])

    def set_by(flags: list[str], where: str) -> dict:
        return {k: v for k, v in engine_kwargs_of_flags(flags, where).items() if v != defaults[k]}

    base: dict = {}
    if stack is not None:
        role = "hybrid" if is_stateful(model_cfg) else "standard"
        spec = stack.role(role)
        if spec.external:
            if spec.mechanisms is None:
                raise ValueError(f"stack {stack.name!r} ({role}) runs an external server and declares no "
                                 "mechanisms: the simulator cannot tell what it does")
            base = mechanism_args(spec.mechanisms, model_cfg)
        else:
            base = set_by(stack.flags(role), f"stack {stack.name!r} ({role}) flags")
    return {**base, **set_by(list(serve_args), "--serve-arg")}


def run(args) -> int:
    from .. import presets
    from ..analyze.models import resolve_model
    from ..bench.replay import BenchAbort
    from ..bench.report_md import md_table
    from ..bench.report_rows import sweep_rows
    from ..bench.stack_files import load_stack_paths
    from ..bench.stacks import STACKS
    from ..config import ConfigError
    from ..simulate import setup as sim_setup
    from ..simulate.run import simulate_bench, sim_bench_config

    out = args.output_dir or time.strftime("flashlane-simulate-%Y%m%d-%H%M%S")
    try:
        if args.calibration and (args.tp or args.ep):
            raise ValueError("--tp / --ep model GPUs: give them with --hardware, not --calibration")
        cfg = resolve_model(args.model).cfg
        stacks = {**STACKS, **(load_stack_paths(args.stacks_file) if args.stacks_file else {})}
        if args.stack is not None and args.stack not in stacks:
            raise ValueError(f"--stack: unknown stack {args.stack!r} (known: {', '.join(stacks)})")
        engine_args = engine_args_for(cfg, stacks.get(args.stack), args.serve_arg)
        if args.calibration:
            from ..machine import machine_info
            setup, warnings = sim_setup.calibrated(args.model, args.calibration, engine_args, machine_info())
            for w in warnings:
                print(f"simulate: warning: {w}", file=sys.stderr)
        else:
            setup = sim_setup.on_hardware(args.model, args.hardware, engine_args, args.tp, args.ep, args.weight_dtype)
        kw = {**common_kwargs(args), **workload_kwargs(args)}
        if kw["tokenizer"] is None and presets.tokenizer_file(args.model) is not None:
            kw["tokenizer"] = args.model     # the text the model's tokenizer counts exactly
        bench_cfg = sim_bench_config(output_dir=out, model=args.model, **kw)
        print(f"simulate: {args.model} ({'calibration ' + args.calibration if args.calibration else args.hardware}), "
              f"server flags: {shlex.join(_flags(setup.engine_args)) or '(defaults)'}; front end: "
              f"{setup.front_end.source}", file=sys.stderr)
        results = simulate_bench(setup, bench_cfg, resolve_tokenizer=presets.tokenizer_file)
    except KeyboardInterrupt:
        print("simulate: interrupted; partial results were written", file=sys.stderr)
        return 130
    except BenchAbort as e:
        print(f"simulate: aborted: {e}", file=sys.stderr)
        return 1
    except (ValueError, ConfigError, OSError) as e:
        print(f"simulate: error: {e}", file=sys.stderr)
        return 2
    head, rows = sweep_rows([(p.label, s) for p, s, _ in results])
    print(md_table(head, rows))
    print(f"results (simulated): {out}")
    from .record import record_results
    record_results(args, "simulate", out)
    return 0


def _flags(engine_args: dict) -> list[str]:
    from .engine_flags import flags_of_engine_kwargs

    return flags_of_engine_kwargs(engine_args)
