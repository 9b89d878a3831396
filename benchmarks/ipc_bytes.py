"""Bytes the engine process sends the HTTP process per step, for 32 decoding sequences.

Runs the engine core in this process (no pipe), steps 32 greedy requests of 32 tokens, and
pickles each ``StepOutputs`` message the core emits as the pipe would (``multiprocessing``'s
ForkingPickler), reporting the first step (prefill) and the median decode step. ``before`` is the
same measurement of the previous wire format (cumulative RequestOutputs re-encoded as positional
delta tuples, commit 5e29231), kept for the comparison.

    python benchmarks/ipc_bytes.py --model tiny-flash
"""

from __future__ import annotations

import argparse
import statistics
from multiprocessing.reduction import ForkingPickler

from common import write_result

from flashlane.engine.core import EngineCore
from flashlane.engine.llm_engine import LLMEngine
from flashlane.engine.messages import StepOutputs
from flashlane.engine.sampling_params import SamplingParams

BEFORE = {"commit": "5e29231", "first_step_bytes": 4714, "decode_step_median_bytes": 2070}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="tiny-flash")
    ap.add_argument("--seqs", type=int, default=32)
    ap.add_argument("--logprobs", type=int, default=None, help="top-k logprobs per token (default: none)")
    ap.add_argument("--out")
    args = ap.parse_args()
    core = EngineCore(LLMEngine(args.model, dtype="float32"))
    params = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True, logprobs=args.logprobs)
    for i in range(args.seqs):
        core.engine.add_request(f"r{i}", [10 + i, *range(20, 52)], params)
    sizes: list[tuple[int, int]] = []

    def emit(msg) -> None:
        if isinstance(msg, StepOutputs):
            sizes.append((len(msg.deltas), len(ForkingPickler.dumps(msg))))

    while core.has_work:
        core.step(emit)
    full = [b for n, b in sizes if n == args.seqs]
    result = {"model": args.model, "seqs": args.seqs, "logprobs": args.logprobs,
              "first_step_bytes": full[0], "decode_step_median_bytes": statistics.median(full[1:]),
              "bytes_per_sequence_decode": statistics.median(full[1:]) / args.seqs}
    if args.logprobs is None:
        result["before"] = BEFORE
        result["decode_bytes_after_over_before"] = result["decode_step_median_bytes"] / BEFORE[
            "decode_step_median_bytes"]
    write_result("ipc_bytes", result, args.out)


if __name__ == "__main__":
    main()
