"""(d) SmolLM2-135M batch-1 decode tokens/s: flashlane vs llama.cpp (llama-cpp-python) on the same
GGUF file. Skips cleanly (exit 0, JSON says why) when llama-cpp-python is not installed.

    python benchmarks/vs_llamacpp.py --new-tokens 128
"""

from __future__ import annotations

import argparse
import time

from common import write_result

from flashlane import LLM, SamplingParams
from flashlane.models.registry import load_model


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--prompt", default="The three most important ideas in computer science are")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--out")
    args = ap.parse_args()
    params = SamplingParams(max_tokens=args.new_tokens, temperature=0, ignore_eos=True)
    result = {"model": args.model, "dtype": args.dtype, "new_tokens": args.new_tokens}
    for quant in (None, "int8"):
        loaded = load_model(args.model, dtype=args.dtype)
        llm = LLM(loaded, dtype=args.dtype, num_threads=args.threads, quantization=quant)
        llm.generate(args.prompt, SamplingParams(max_tokens=4))
        m = llm.generate(args.prompt, params)[0].metrics
        key = "flashlane" if quant is None else f"flashlane_{quant}"
        result[f"{key}_decode_tok_s"] = (len(m.token_times) - 1) / (m.token_times[-1] - m.token_times[0])
        result[f"{key}_ttft_s"] = m.first_token_time - m.arrival_time
    result["gguf"] = str(loaded.path)
    try:
        from llama_cpp import Llama
    except ImportError:
        result["llama_cpp"] = "skipped: llama-cpp-python is not installed (pip install llama-cpp-python)"
        write_result("vs_llamacpp", result, args.out)
        return
    lcpp = Llama(model_path=str(loaded.path), n_ctx=1024, n_threads=args.threads, verbose=False)
    tokens = lcpp.tokenize(args.prompt.encode())
    lcpp.eval(tokens)
    t = time.perf_counter()
    n = 0
    for _ in lcpp.generate(tokens, top_k=1, temp=0.0, reset=True):
        n += 1
        if n == 1:
            t_first = time.perf_counter()
        if n >= args.new_tokens:
            break
    t_end = time.perf_counter()
    result.update({"llama_cpp_decode_tok_s": (n - 1) / (t_end - t_first), "llama_cpp_ttft_s": t_first - t})
    for key in ("flashlane", "flashlane_int8"):
        result[f"ratio_{key}_over_llama_cpp"] = result[f"{key}_decode_tok_s"] / result["llama_cpp_decode_tok_s"]
    write_result("vs_llamacpp", result, args.out)


if __name__ == "__main__":
    main()
