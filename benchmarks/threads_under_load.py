"""Decode speed vs torch thread count and OpenMP wait policy, on an idle machine and beside a
co-tenant that keeps one core busy (the situation of a laptop or a shared CI runner).

For each model and repetition, one child process per OMP_WAIT_POLICY (unset, ACTIVE, PASSIVE;
OpenMP reads it once, at start, so it cannot change inside a process) loads the model and
measures threads 1..--max-threads x co-tenant off/on, interleaved. Decode tok/s of one greedy
sequence via LLM.generate is (N extra tokens) / (time of a 1+N-token generation - time of a
1-token one), so the prompt's prefill cancels out. The co-tenant is a busy-loop process pinned to the last CPU, started here.
The load average is recorded before every measurement: other work on the machine shows there.

    python benchmarks/threads_under_load.py --models tiny-flash,smollm2-135m --reps 2 --tokens 8

benchmarks/results/threads_under_load_busy.json: --reps 2 --tokens 8 while other test runs kept
the 1-minute load average at 3-6 on 2 cores; threads_under_load_quiet.json: --reps 1 --tokens 16
at a load average of 0.7-1.4 (the run itself included).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import subprocess
import sys
import time
from contextlib import contextmanager

from common import write_result

# unset: libgomp's default (spin a while, then sleep); active: spin; passive: sleep at once
POLICIES = ("unset", "active", "passive")
PROMPT = "The quick brown fox jumps over the lazy dog. " * 2


def _spin(parent: int) -> None:
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {max(os.sched_getaffinity(0))})
    while os.getppid() == parent:   # ends with the process that started it, however that ends
        for _ in range(1_000_000):
            pass


@contextmanager
def cotenant(on: bool):
    if not on:
        yield
        return
    proc = mp.get_context("spawn").Process(target=_spin, args=(os.getpid(),), daemon=True)
    proc.start()
    time.sleep(0.3)   # let it reach the loop
    try:
        yield
    finally:
        proc.terminate()
        proc.join()


def decode_tok_s(llm, tokens: int) -> float:
    from flashlane import SamplingParams

    def timed(n: int) -> float:
        t0 = time.perf_counter()
        llm.generate(PROMPT, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True))
        return time.perf_counter() - t0

    return tokens / max(timed(1 + tokens) - timed(1), 1e-9)


def child(model: str, max_threads: int, tokens: int) -> None:
    """One process, one wait policy: every (threads, co-tenant) point once; JSON lines on stdout."""
    import torch

    from flashlane.engine.llm import LLM

    llm = LLM(model, dtype="float32", cache_memory=64 << 20, max_model_len=512)
    decode_tok_s(llm, 4)   # warm-up
    for on in (False, True):
        with cotenant(on):
            for threads in range(1, max_threads + 1):
                torch.set_num_threads(threads)
                load = os.getloadavg()[0]
                print(json.dumps({"threads": threads, "cotenant": on, "loadavg_1m": load,
                                  "tok_s": decode_tok_s(llm, tokens)}), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="tiny-flash,smollm2-135m")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=24)
    ap.add_argument("--max-threads", type=int, default=len(os.sched_getaffinity(0)))
    ap.add_argument("--child", nargs=3, metavar=("MODEL", "MAX_THREADS", "TOKENS"), help=argparse.SUPPRESS)
    ap.add_argument("--out")
    args = ap.parse_args()
    if args.child:
        child(args.child[0], int(args.child[1]), int(args.child[2]))
        return

    load_at_start = os.getloadavg()
    samples = []
    for rep in range(args.reps):
        for model in args.models.split(","):
            for policy in (POLICIES if rep % 2 == 0 else POLICIES[::-1]):   # A/B/C, then C/B/A
                env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
                if policy != "unset":
                    env["OMP_WAIT_POLICY"] = policy.upper()
                out = subprocess.run([sys.executable, __file__, "--child", model, str(args.max_threads),
                                      str(args.tokens)], env=env, capture_output=True, text=True, check=True)
                for line in out.stdout.splitlines():
                    if line.startswith("{"):
                        samples.append({"model": model, "policy": policy, "rep": rep, **json.loads(line)})
                        print(samples[-1], file=sys.stderr)
                write(args, load_at_start, samples)   # so far: a stopped run keeps what it measured


def write(args, load_at_start, samples) -> None:
    summary = {}
    for s in samples:
        key = f"{s['model']} threads={s['threads']} wait={s['policy']} cotenant={'on' if s['cotenant'] else 'off'}"
        summary.setdefault(key, []).append(s["tok_s"])
    summary = {k: {"median_tok_s": round(statistics.median(v), 2), "min": round(min(v), 2),
                   "max": round(max(v), 2), "n": len(v)} for k, v in sorted(summary.items())}
    write_result("threads_under_load", {
        "settings": {"models": args.models, "reps": args.reps, "tokens": args.tokens,
                     "max_threads": args.max_threads, "cpus": len(os.sched_getaffinity(0))},
        "loadavg_at_start": load_at_start, "loadavg_at_end": os.getloadavg(), "summary": summary,
        "samples": samples}, args.out)


if __name__ == "__main__":
    main()
