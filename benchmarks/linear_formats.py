"""Issue 22: the float linears' format (engine arg ``linear_kernel``) and the cpu backend's
native kernels on this CPU, in the engine. Each side is the same model loaded once more with a
linear format and a glue: ``aten`` (weights as loaded, torch's matmul: MKL on x86), ``onednn``
(reordered for oneDNN) or ``native`` (as loaded, few rows through flashlane's kernel); ``torch``
(gather + SDPA decode attention, torch RMSNorm and RoPE) or ``native`` (the backend's native
decode attention reading the pool in place, native RMSNorm and RoPE). Sides are named
``<linear>+<glue>``; the first is the reference. They are stepped in rotating order per round
(A B C, C B A, ...) so all see the same machine. Per round and side: the mean decode step at batch
1 and 8 (at ``--context`` tokens) and one prefill of ``--prefill`` tokens; ratios are geometric
means of the per-round ratios against the reference with a t interval (> 1: faster than the
reference). Also what ``linear_kernel="auto"`` chose here, with its timings, at each thread count.

    python benchmarks/linear_formats.py [--model smollm2-135m] [--threads 1,2] [--rounds 4]
        [--sides aten+torch,native+torch,native+native,onednn+torch]
"""

from __future__ import annotations

import argparse
import random
import time

import torch
from common import write_result

from flashlane.bench.stats import paired_ratio_ci
from flashlane.engine.llm_engine import LLMEngine
from flashlane.engine.sampling_params import SamplingParams
from flashlane.kernels.linear_plan import choose_linear_plan

SIDES = ("aten+torch", "native+torch", "native+native")


def parse_side(side: str) -> tuple[str, bool]:
    """``<linear>+<attention>`` -> (linear_kernel, native decode attention)."""
    linear, _, attention = side.partition("+")
    if linear not in ("aten", "onednn", "native") or attention not in ("torch", "native"):
        raise SystemExit(f"--sides: {side!r} is not <aten|onednn|native>+<torch|native>")
    return linear, attention == "native"


def decode_step_s(engine: LLMEngine, batch: int, context: int, steps: int, rng: random.Random) -> float:
    vocab = engine.config.vocab_size
    params = SamplingParams(max_tokens=steps + 3, temperature=0, ignore_eos=True)
    reqs = [engine.add_request(f"d{rng.random()}", [rng.randrange(3, vocab) for _ in range(context)], params)
            for _ in range(batch)]
    try:
        while any(not r.output_token_ids for r in reqs):
            engine.step()
        engine.step()
        t0 = time.perf_counter()
        for _ in range(steps):
            engine.step()
        return (time.perf_counter() - t0) / steps
    finally:
        for r in reqs:
            engine.abort(r.request_id)


def prefill_s(engine: LLMEngine, tokens: int, rng: random.Random) -> float:
    vocab = engine.config.vocab_size
    req = engine.add_request(f"p{rng.random()}", [rng.randrange(3, vocab) for _ in range(tokens)],
                             SamplingParams(max_tokens=1, temperature=0, ignore_eos=True))
    try:
        t0 = time.perf_counter()
        while not req.output_token_ids:
            engine.step()
        return time.perf_counter() - t0
    finally:
        engine.abort(req.request_id)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--prefill", type=int, default=1024)
    ap.add_argument("--sides", default=",".join(SIDES), help="<linear>+<glue> per side; the first is the reference")
    ap.add_argument("--out")
    args = ap.parse_args()
    sides = [s for s in args.sides.split(",") if s]
    parsed = {s: parse_side(s) for s in sides}
    ref = sides[0]
    runs = []
    for threads in (int(t) for t in args.threads.split(",")):
        torch.set_num_threads(threads)
        auto = choose_linear_plan("auto", torch.float32)
        engines = {s: LLMEngine(args.model, dtype="float32", num_threads=threads, linear_kernel=parsed[s][0],
                                enable_prefix_caching=False, max_num_batched_tokens=args.prefill) for s in sides}
        samples = {s: {"decode_b1_s": [], "decode_b8_s": [], "prefill_s": []} for s in sides}
        for r in range(args.rounds):
            for side in (sides if r % 2 == 0 else sides[::-1]):
                eng, rng = engines[side], random.Random(r)          # the same prompts on every side
                eng.ops.native = parsed[side][1]   # the backend object is shared: set per side
                samples[side]["decode_b1_s"].append(decode_step_s(eng, 1, args.context, args.steps, rng))
                samples[side]["decode_b8_s"].append(decode_step_s(eng, 8, args.context, args.steps, rng))
                samples[side]["prefill_s"].append(prefill_s(eng, args.prefill, rng))
                print(threads, r, side, {k: round(v[-1] * 1e3, 1) for k, v in samples[side].items()}, flush=True)
        speedup = {s: {k: paired_ratio_ci(samples[ref][k], samples[s][k]) for k in samples[ref]}
                   for s in sides[1:]}
        runs.append({"threads": threads, "auto": {"format": auto.format, "why": auto.why},
                     "linear_kernel": {s: engines[s].info.linear_kernel for s in sides},
                     "samples": samples, "speedup_vs_reference": speedup})
        del engines
    write_result("linear_formats", {"model": args.model, "dtype": "float32", "rounds": args.rounds,
                                    "context": args.context, "steps": args.steps, "prefill_tokens": args.prefill,
                                    "reference": ref, "order": "rotating per round (A B C, C B A, ...)",
                                    "runs": runs}, args.out)


if __name__ == "__main__":
    main()
