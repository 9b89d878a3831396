"""`flashlane profile MODEL`: where a decode step and a prefill chunk spend their time, per layer type."""

from __future__ import annotations

import argparse

from .engine_flags import add_engine_flags, apply_thread_default, engine_kwargs
from .help import HelpFormatter


def _positive(value: str) -> int:
    try:
        v = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {value!r}") from None
    if v < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {v}")
    return v


def add_parser(sub):
    p = sub.add_parser(
        "profile", formatter_class=HelpFormatter,
        help="per-layer-type time of decode and prefill steps (torch.profiler), with a trace file",
        description="Runs --batch sequences at --context tokens through the engine, profiles --steps decode "
                    "steps and one prefill chunk of --prefill-tokens, prints time, share and aten op count per "
                    "layer type, and writes Chrome/Perfetto traces (NVTX ranges of the same names on CUDA) "
                    "and profile.json to --output-dir.")
    p.add_argument("model", help="preset, checkpoint folder or .gguf file")
    p.add_argument("--batch", type=_positive, default=4, help="decode batch (sequences stepped together)")
    p.add_argument("--context", type=_positive, default=512, help="tokens of context per sequence")
    p.add_argument("--steps", type=_positive, default=8, help="decode steps profiled")
    p.add_argument("--prefill-tokens", type=_positive, default=512, help="tokens of the profiled prefill chunk")
    p.add_argument("--output-dir", default="flashlane-profile", help="where traces and profile.json go")
    p.add_argument("--json", action="store_true", help="print profile.json instead of the tables")
    add_engine_flags(p)
    return p


def format_table(title: str, phase: dict, unit: str) -> str:
    rows = sorted(((k, v) for k, v in phase["categories"].items() if v["calls"]), key=lambda kv: -kv[1]["ms"])
    lines = [title, f"  {'layer type':<16} {'ms/' + unit:>10} {'share':>7} {'aten ops':>9}"]
    lines += [f"  {k:<16} {v['ms']:>10.3f} {100 * v['share']:>6.1f}% {v['aten_ops']:>9.0f}" for k, v in rows]
    lines.append(f"  {'sum':<16} {phase['ms']:>10.3f} {'100.0%':>7} {phase['aten_ops']:>9.0f}")
    lines.append(f"  measured: {phase['ms_measured']:.3f} ms/{unit} under the profiler, "
                 f"{phase['ms_unprofiled']:.3f} ms/{unit} without it")
    return "\n".join(lines)


def run(args) -> int:
    import json

    apply_thread_default(args)   # before torch loads
    from ..engine.llm_engine import LLMEngine
    from ..engine.profile_steps import profile_steps

    engine = LLMEngine(args.model, **engine_kwargs(args))
    try:
        result = profile_steps(engine, args.batch, args.context, args.steps, args.prefill_tokens, args.output_dir,
                               seed=args.seed)
    finally:
        engine.close()
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    m = result["machine"]
    print(f"{result['model']} ({result['arch']}, {result['dtype']}) on {m['cpu_model']}, {m['cpu_capability']}, "
          f"torch threads: {m['torch_threads']}")
    print(format_table(f"decode: batch {result['batch']} at {result['context']} tokens of context, "
                       f"{result['steps']} steps", result["decode"], "step"))
    print(format_table(f"prefill: one prompt of {result['prefill_tokens']} tokens "
                       f"({result['prefill']['steps']} engine steps)", result["prefill"], "prompt"))
    print(f"traces: {result['traces']['decode']}, {result['traces']['prefill']} (chrome://tracing or "
          f"ui.perfetto.dev); summary: {args.output_dir}/profile.json")
    return 0
