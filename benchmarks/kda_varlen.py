"""KDA prefill on CPU: per-sequence `kda_chunk` loop (today's model path) vs `kda_chunk_varlen`.

Shapes: a typical mixed step (4 x 512 + 1 x 2048 tokens) and single long sequences (4K, 16K), each at
H=4/D=64 and H=8/D=128, with initial states. The varlen kernel runs at several chunk sizes; every
row reports ms (best of `--repeats`), the speed-up over the loop, and the max abs difference of the
outputs to the loop's (a speed-up of a wrong kernel is worth nothing).

    python benchmarks/kda_varlen.py --chunk-sizes 32,64,128 --repeats 3
    python benchmarks/kda_varlen.py --threads 1 --clock cpu      # on a busy machine
"""

from __future__ import annotations

import argparse
import itertools
import time

import torch
from common import write_result

from flashlane.kernels.kda import kda_chunk, kda_chunk_varlen

CASES = {"step_4x512_1x2048": [512] * 4 + [2048], "long_4k": [4096], "long_16k": [16384]}


def inputs(lengths, h, d, seed=0):
    gen = torch.Generator().manual_seed(seed)
    n = sum(lengths)
    q, k, v = (torch.randn(n, h, d, generator=gen) for _ in range(3))
    g = -5.0 * torch.sigmoid(torch.randn(n, h, d, generator=gen))      # lower-bound gate form
    beta = torch.rand(n, h, generator=gen)
    s0 = torch.randn(len(lengths), h, d, d, generator=gen) * 0.1
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int64)
    return q, k, v, g, beta, cu, s0


def loop(q, k, v, g, beta, cu, s0):
    """What KDAAttention._mixed does today: one kda_chunk call per prefill sequence."""
    out = torch.empty_like(v)
    finals = []
    bounds = cu.tolist()
    for b, (s, e) in enumerate(itertools.pairwise(bounds)):
        o, st = kda_chunk(q[None, s:e], k[None, s:e], v[None, s:e], g[None, s:e], beta[None, s:e], s0[b : b + 1])
        out[s:e] = o[0]
        finals.append(st[0])
    return out, torch.stack(finals)


def best_ms(fn, repeats, clock):
    times = []
    for _ in range(repeats):
        t0 = clock()
        result = fn()
        times.append(clock() - t0)
    return 1000 * min(times), result


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", default=",".join(CASES))
    ap.add_argument("--heads-dims", default="4x64,8x128", help="comma list of HxD")
    ap.add_argument("--chunk-sizes", default="32,64,128")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                    help="cpu: this process's CPU time, steadier on a loaded machine (use with --threads 1)")
    ap.add_argument("--out")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    chunk_sizes = [int(c) for c in args.chunk_sizes.split(",")]
    clock = time.perf_counter if args.clock == "wall" else time.process_time
    rows = []
    with torch.inference_mode():
        for hd in args.heads_dims.split(","):
            h, d = (int(x) for x in hd.split("x"))
            for case in args.cases.split(","):
                x = inputs(CASES[case], h, d)
                loop_ms, (want_o, want_s) = best_ms(lambda x=x: loop(*x), args.repeats, clock)
                row = {"case": case, "lengths": CASES[case], "heads": h, "head_dim": d, "loop_ms": loop_ms,
                       "varlen": {}}
                for c in chunk_sizes:
                    ms, (o, s) = best_ms(lambda x=x, c=c: kda_chunk_varlen(*x, chunk_size=c),
                                         args.repeats, clock)
                    row["varlen"][str(c)] = {"ms": ms, "speedup": loop_ms / ms,
                                             "max_abs_diff_o": (o - want_o).abs().max().item(),
                                             "max_abs_diff_state": (s - want_s).abs().max().item()}
                rows.append(row)
                print(case, hd, f"loop {loop_ms:.1f} ms",
                      " ".join(f"c{c}: {v['ms']:.1f} ms x{v['speedup']:.2f}" for c, v in row["varlen"].items()),
                      flush=True)
    write_result("kda_varlen", {"cpu_capability": torch.backends.cpu.get_cpu_capability(),
                                "threads": torch.get_num_threads(), "clock": args.clock, "repeats": args.repeats,
                                "chunk_sizes": chunk_sizes, "rows": rows}, args.out)


if __name__ == "__main__":
    main()
