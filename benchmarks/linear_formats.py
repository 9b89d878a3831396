"""Issue 22: the float linears' weight format (engine arg ``linear_kernel``) on this CPU, in the
engine: the same model loaded twice, once with its weights as loaded (``aten``: torch's matmul,
MKL on x86) and once reordered for oneDNN (``onednn``), stepped alternately (A B, B A, ...) so
both sides see the same machine. Per round and side: the mean decode step at batch 1 and 8 (at
``--context`` tokens) and one prefill of ``--prefill`` tokens; ratios are geometric means of the
per-round ratios with a t interval (> 1: onednn faster). Also what ``linear_kernel="auto"`` chose
here, with its timings, at each thread count.

    python benchmarks/linear_formats.py [--model smollm2-135m] [--threads 1,2] [--rounds 4]
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

SIDES = ("aten", "onednn")


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
    ap.add_argument("--out")
    args = ap.parse_args()
    runs = []
    for threads in (int(t) for t in args.threads.split(",")):
        torch.set_num_threads(threads)
        auto = choose_linear_plan("auto", torch.float32)
        engines = {s: LLMEngine(args.model, dtype="float32", num_threads=threads, linear_kernel=s,
                                enable_prefix_caching=False, max_num_batched_tokens=args.prefill) for s in SIDES}
        samples = {s: {"decode_b1_s": [], "decode_b8_s": [], "prefill_s": []} for s in SIDES}
        for r in range(args.rounds):
            for side in (SIDES if r % 2 == 0 else SIDES[::-1]):
                eng, rng = engines[side], random.Random(r)          # the same prompts on both sides
                samples[side]["decode_b1_s"].append(decode_step_s(eng, 1, args.context, args.steps, rng))
                samples[side]["decode_b8_s"].append(decode_step_s(eng, 8, args.context, args.steps, rng))
                samples[side]["prefill_s"].append(prefill_s(eng, args.prefill, rng))
                print(threads, r, side, {k: round(v[-1] * 1e3, 1) for k, v in samples[side].items()}, flush=True)
        speedup = {k: paired_ratio_ci(samples["aten"][k], samples["onednn"][k]) for k in samples["aten"]}
        runs.append({"threads": threads, "auto": {"format": auto.format, "why": auto.why},
                     "packed_linears": engines["onednn"].info.linear_kernel["linears"],
                     "samples": samples, "onednn_speedup": speedup})
        del engines
    write_result("linear_formats", {"model": args.model, "dtype": "float32", "rounds": args.rounds,
                                    "context": args.context, "steps": args.steps, "prefill_tokens": args.prefill,
                                    "order": "ABBA per round, A=aten", "runs": runs}, args.out)


if __name__ == "__main__":
    main()
