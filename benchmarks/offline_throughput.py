"""(c) nano-vllm-style offline run: N sequences, random input and output lengths in [lo, hi],
ignore_eos, all submitted at once; reports output tokens/s and total tokens/s.

    python benchmarks/offline_throughput.py --model tiny-flash --num-seqs 64
"""

from __future__ import annotations

import argparse
import random

from common import Timer, write_result

from flashlane import LLM, SamplingParams


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="tiny-flash")
    ap.add_argument("--num-seqs", type=int, default=64)
    ap.add_argument("--min-len", type=int, default=100)
    ap.add_argument("--max-len", type=int, default=1024)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out")
    args = ap.parse_args()
    rng = random.Random(args.seed)
    llm = LLM(args.model, dtype=args.dtype, max_num_seqs=args.num_seqs,
              max_num_batched_tokens=args.max_num_batched_tokens)
    vocab = min(llm.engine.config.vocab_size, 30000)
    prompts = [[rng.randrange(10, vocab) for _ in range(rng.randint(args.min_len, args.max_len))]
               for _ in range(args.num_seqs)]
    params = [SamplingParams(max_tokens=rng.randint(args.min_len, args.max_len), temperature=0.6,
                             ignore_eos=True, seed=i) for i in range(args.num_seqs)]
    llm.generate([[11, 12, 13]], SamplingParams(max_tokens=4))  # warm-up
    with Timer() as t:
        outs = llm.generate(prompts, params)
    out_tokens = sum(len(o.token_ids) for o in outs)
    in_tokens = sum(len(p) for p in prompts)
    steps = list(llm.engine.step_stats)
    write_result(f"offline_throughput_{args.model}", {
        "model": args.model, "dtype": args.dtype, "num_seqs": args.num_seqs,
        "input_tokens": in_tokens, "output_tokens": out_tokens, "seconds": t.seconds,
        "output_tokens_per_s": out_tokens / t.seconds, "total_tokens_per_s": (in_tokens + out_tokens) / t.seconds,
        "steps": len(steps), "mean_batch_seqs": sum(s.num_seqs for s in steps) / max(len(steps), 1),
        "preemptions": llm.engine.scheduler.num_preemptions, "engine": llm.engine.startup,
    }, args.out)


if __name__ == "__main__":
    main()
