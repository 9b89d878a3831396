"""(d) SmolLM2-135M batch-1 decode tokens/s: flashlane (fp32, int8, w8a8; eager and with
``compile=True``) vs llama.cpp (llama-cpp-python) on the same GGUF file and on its Q8_0
requantisation (int8 against int8), both sides on the same number of threads (llama-cpp-python's
default is half the cores). Then the same ``--streams`` requests served at once: flashlane's
continuous batching against llama-cpp-python, which runs one sequence at a time (its ``Llama``
object and server have no batching across requests), as aggregate generated tokens/s.
Skips llama.cpp cleanly (exit 0, JSON says why) when llama-cpp-python is not installed.

    python benchmarks/vs_llamacpp.py --new-tokens 128 --threads 2
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import tempfile
import time
from pathlib import Path

import torch
from common import write_result
from gguf_requant import requantize

from flashlane import LLM, SamplingParams
from flashlane.models.registry import load_model


def stream_prompts(args) -> list[str]:
    return [f"{args.prompt} (request {i + 1})" for i in range(args.streams)]


def flashlane_decode(args, quant: str | None, compile: bool) -> dict:
    loaded = load_model(args.model, dtype=args.dtype)
    sizes = sorted({1, args.streams})
    llm = LLM(loaded, dtype=args.dtype, num_threads=args.threads, quantization=quant, compile=compile,
              compile_sizes=sizes, max_num_seqs=max(sizes))
    llm.generate(args.prompt, SamplingParams(max_tokens=4))
    params = SamplingParams(max_tokens=args.new_tokens, temperature=0, ignore_eos=True)
    m = llm.generate(args.prompt, params)[0].metrics
    t = time.perf_counter()
    outs = llm.generate(stream_prompts(args), params)
    wall = time.perf_counter() - t
    return {"decode_tok_s": (len(m.token_times) - 1) / (m.token_times[-1] - m.token_times[0]),
            "ttft_s": m.first_token_time - m.arrival_time, "weights": llm.engine.describe_weights(),
            "compiled_decode": llm.engine.info.compiled_decode,
            "streams_tok_s": sum(len(o.token_ids) for o in outs) / wall, "gguf": str(loaded.path)}


def llama_cpp_decode(path: str, args) -> dict:
    """llama.cpp in a child process, so an illegal instruction in its CPU build (seen with a
    -march=native build where the VM does not enable what CPUID reports) is a result, not a crash."""
    from concurrent.futures import ProcessPoolExecutor
    from concurrent.futures.process import BrokenProcessPool
    from multiprocessing import get_context

    with ProcessPoolExecutor(1, mp_context=get_context("spawn")) as pool:
        try:
            return pool.submit(_llama_cpp_decode, path, args).result()
        except BrokenProcessPool as e:
            return {"error": f"llama.cpp process died ({e}); a CPU build without -march=native may help",
                    "gguf": path}


def _llama_cpp_decode(path: str, args) -> dict:
    from llama_cpp import Llama

    lcpp = Llama(model_path=path, n_ctx=1024, n_threads=args.threads, n_threads_batch=args.threads, verbose=False)
    tokens = lcpp.tokenize(args.prompt.encode())
    t = time.perf_counter()
    n = 0
    for _ in lcpp.generate(tokens, top_k=1, temp=0.0, reset=True):
        n += 1
        if n == 1:
            t_first = time.perf_counter()
        if n >= args.new_tokens:
            break
    t_end = time.perf_counter()
    result = {"decode_tok_s": (n - 1) / (t_end - t_first), "ttft_s": t_first - t, "gguf": path}
    t, generated = time.perf_counter(), 0
    for prompt in stream_prompts(args):          # one sequence at a time: what llama-cpp-python serves
        for i, _ in enumerate(lcpp.generate(lcpp.tokenize(prompt.encode()), top_k=1, temp=0.0, reset=True)):
            generated += 1
            if i + 1 >= args.new_tokens:
                break
    result["streams_tok_s"] = generated / (time.perf_counter() - t)
    return result


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--prompt", default="The three most important ideas in computer science are")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--threads", type=int, default=None, help="threads for both sides (default: torch's)")
    ap.add_argument("--quantizations", default="none,int8,w8a8", help="flashlane configurations to run")
    ap.add_argument("--q8-dir", default=None, help="where the Q8_0 requantisation is written (default: a temp dir)")
    ap.add_argument("--streams", type=int, default=16, help="requests served at once for the aggregate comparison")
    ap.add_argument("--no-compile", action="store_true", help="skip flashlane's static-graph decode runs")
    ap.add_argument("--out")
    args = ap.parse_args()
    args.threads = args.threads or torch.get_num_threads()
    torch.set_num_threads(args.threads)
    result = {"model": args.model, "dtype": args.dtype, "new_tokens": args.new_tokens, "streams": args.streams,
              "threads": args.threads, "threads_note": "flashlane and llama.cpp both ran on this many threads",
              "load_average_1m_at_start": os.getloadavg()[0]}
    for q in args.quantizations.split(","):
        quant = None if q == "none" else q
        key = "flashlane" if quant is None else f"flashlane_{quant}"
        for compile in (False,) if args.no_compile else (False, True):
            result[key + ("_compiled" if compile else "")] = flashlane_decode(args, quant, compile)
    if importlib.util.find_spec("llama_cpp") is None:
        result["llama_cpp"] = ("skipped: llama-cpp-python is not installed (pip install llama-cpp-python; "
                               "it builds llama.cpp from source)")
        write_result("vs_llamacpp", result, args.out)
        return
    shipped = next(v["gguf"] for k, v in result.items() if k.startswith("flashlane"))
    q8_dir = Path(args.q8_dir or tempfile.mkdtemp(prefix="flashlane-q8-"))
    q8 = requantize(shipped, q8_dir / (Path(shipped).stem + ".Q8_0-requant.gguf"), "Q8_0")
    result["llama_cpp"] = llama_cpp_decode(shipped, args)
    result["llama_cpp_q8_0"] = llama_cpp_decode(str(q8), args)
    for key in [k for k in result if k.startswith("flashlane")]:
        for peer in [p for p in ("llama_cpp", "llama_cpp_q8_0") if "error" not in result[p]]:
            result[f"ratio_{key}_over_{peer}"] = result[key]["decode_tok_s"] / result[peer]["decode_tok_s"]
            result[f"streams_ratio_{key}_over_{peer}"] = (result[key]["streams_tok_s"]
                                                          / result[peer]["streams_tok_s"])
    write_result("vs_llamacpp", result, args.out)


if __name__ == "__main__":
    main()
