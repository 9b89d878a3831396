"""`flashlane analyze MODEL [--baseline B]`: the analytic cost model, as a table or JSON."""

from __future__ import annotations

import argparse
import json
import sys

from ..config import ConfigError
from .help import HelpFormatter


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "analyze", help="parameters, cache, FLOPs, memory and a roofline projection from a config",
        description="Analytic cost model of a model config (no weights, no torch). MODEL and --baseline are a "
                    "config.json, a checkpoint folder or a preset (glm-5.3-flash, glm-5.3, tiny-flash, ...).",
        formatter_class=HelpFormatter)
    p.add_argument("model", help="config.json, checkpoint folder or preset")
    p.add_argument("--baseline", help="second model; ratios are baseline / model (default: none)")
    p.add_argument("--context", default="8k,128k,1m", help="comma-separated contexts (k = 1024, m = 1024^2)")
    p.add_argument("--hardware", default="h200", help="h100, h200, b200, mi355x or local (measured)")
    p.add_argument("--json", action="store_true", help="print JSON with stable keys instead of the table")
    p.add_argument("--tp", type=int, default=8, help="tensor-parallel degree (attention side)")
    p.add_argument("--dp", type=int, default=1, help="attention data-parallel groups; devices = tp x dp")
    p.add_argument("--weight-dtype", default="fp8", choices=("bf16", "fp8", "int8"), help="dtype of the weights")
    p.add_argument("--kv-dtype", "--kv-cache-dtype", dest="kv_dtype", default="bf16",
                   choices=("bf16", "bfloat16", "fp8", "int8"),
                   help="dtype of the KV cache (bf16 = bfloat16 and int8 are the engine's --kv-cache-dtype "
                        "layouts; fp8 is the serving-stack layout)")
    p.add_argument("--batch", type=int, default=32, help="decode batch / task concurrency for the roofline")
    p.add_argument("--task", default="agentic",
                   help="task profile: 'agentic', a spec like turns=30,prefix=12k,in=1.5k,out=400, "
                        "or an AgentX trace .json")
    p.add_argument("--usd-per-gpu-hour", type=float, default=None,
                   help="override the hardware's price (default: the hardware table's)")
    p.add_argument("--mfu", type=float, default=0.6, help="fraction of peak FLOP/s reached")
    p.add_argument("--mbu", type=float, default=0.8, help="fraction of peak bandwidth reached")
    return p


def run(args) -> int:
    from ..analyze import Layout, Options, Setup, build_report, get_hardware, load_task, render_text, resolve_model
    from ..analyze.units import parse_token_list

    try:
        contexts = tuple(parse_token_list(args.context))
        if args.batch < 1:
            raise ValueError(f"--batch must be >= 1, got {args.batch}")
        models = [resolve_model(args.model)]
        if args.baseline:
            models.append(resolve_model(args.baseline))
        setup = Setup(get_hardware(args.hardware, args.usd_per_gpu_hour), Layout(args.tp, args.dp),
                      args.weight_dtype, "bf16" if args.kv_dtype == "bfloat16" else args.kv_dtype,
                      args.mfu, args.mbu)
        report = build_report(models, setup, load_task(args.task), Options(contexts, args.batch))
    except (ConfigError, ValueError) as exc:
        print(f"flashlane analyze: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(report, indent=2) if args.json else render_text(report))
    return 0

