"""Where a step's time goes, per layer type, at decode batch 1 and 16 and for one prefill prompt:
`flashlane profile` (engine/profile_steps.py) at both batch sizes, in one result file.

    python benchmarks/profile_step.py --model tiny-flash [--compile] [--context 512]

A single setting, with the per-layer-type table printed: `flashlane profile MODEL --batch B ...`.
"""

from __future__ import annotations

import argparse
import tempfile

from common import write_result

from flashlane.engine.llm_engine import LLMEngine
from flashlane.engine.profile_steps import profile_steps


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="tiny-flash")
    ap.add_argument("--batches", default="1,16", help="comma-separated decode batch sizes")
    ap.add_argument("--context", type=int, default=64, help="tokens of context per sequence")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--prefill-tokens", type=int, default=1024)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--compile", action="store_true")
    ap.add_argument("--trace-dir", default=None, help="keep the Chrome traces here (default: discarded)")
    ap.add_argument("--out")
    args = ap.parse_args()
    eng = LLMEngine(args.model, dtype="float32", num_threads=args.threads, compile=args.compile)
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        for b in (int(x) for x in args.batches.split(",")):
            runs.append(profile_steps(eng, b, args.context, args.steps, args.prefill_tokens,
                                      f"{args.trace_dir or tmp}/batch{b}"))
    write_result(f"profile_step_{args.model}{'_compiled' if args.compile else ''}", {
        "model": args.model, "threads": args.threads, "compile": args.compile, "context": args.context,
        "decode": [{"batch": r["batch"], **r["decode"]} for r in runs], "prefill": runs[0]["prefill"]}, args.out)


if __name__ == "__main__":
    main()
