"""(b) decode step time vs context length, tiny-flash vs tiny-standard in the same run.

For each context T: prefill one random prompt of T tokens through the engine (chunked), then time
`--steps` decode steps at batch `--batch` (the same context for every sequence). Reports ms/step and
the flash/standard ratio per T.

    python benchmarks/decode_vs_context.py --contexts 1024,4096,16384,32768
"""

from __future__ import annotations

import argparse
import time

from common import write_result

from flashlane import SamplingParams
from flashlane.engine.llm_engine import LLMEngine


def decode_ms(model: str, context: int, batch: int, steps: int, dtype: str) -> dict:
    eng = LLMEngine(model, dtype=dtype, max_num_seqs=batch, max_num_batched_tokens=4096,
                    cache_memory=2 * 1024**3, max_model_len=context + steps + 8)
    vocab = min(eng.config.vocab_size, 30000)
    for b in range(batch):
        prompt = [(7 + 31 * i + 17 * b) % (vocab - 10) + 10 for i in range(context)]
        eng.add_request(f"r{b}", prompt, SamplingParams(max_tokens=steps + 2, temperature=0, ignore_eos=True))
    t0 = time.perf_counter()
    while any(not r.output_token_ids for r in eng.requests.values()):
        eng.step()
    prefill_s = time.perf_counter() - t0
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        eng.step()
        times.append(time.perf_counter() - t)
    times.sort()
    return {"prefill_s": prefill_s, "decode_ms_median": 1000 * times[len(times) // 2],
            "decode_ms_min": 1000 * times[0], "tokens_per_s": batch / times[len(times) // 2]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="tiny-flash,tiny-standard")
    ap.add_argument("--contexts", default="1024,4096,16384,32768")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--out")
    args = ap.parse_args()
    models = args.models.split(",")
    rows = []
    for ctx in (int(c) for c in args.contexts.split(",")):
        row = {"context": ctx}
        for m in models:
            row[m] = decode_ms(m, ctx, args.batch, args.steps, args.dtype)
            print(ctx, m, row[m], flush=True)
        if len(models) == 2:
            row["ratio_decode_ms"] = row[models[0]]["decode_ms_median"] / row[models[1]]["decode_ms_median"]
        rows.append(row)
    write_result("decode_vs_context", {"models": models, "batch": args.batch, "dtype": args.dtype,
                                       "rows": rows}, args.out)


if __name__ == "__main__":
    main()
