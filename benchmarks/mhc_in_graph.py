"""The mHC weights inside a static decode graph: the native kernel as one opaque op (what the cpu
backend hands a graph) against the torch formulas traced into it (their Sinkhorn iterations unroll
into ~150 ops per mHC). Both sets of regional graphs are compiled in one process on the same
engine, then timed interleaved (paired rounds, A/B order alternating) on the same padded decode
batch per bucket, so the neighbours' load moves both alike; the answer is the per-round ratio.
The cold compile of each way is ``regional_compile.py`` run on the trees before and after.

    python benchmarks/mhc_in_graph.py [--preset tiny-flash] [--out PATH]
"""

from __future__ import annotations

import argparse
import statistics
import time

from common import write_result
from regional_compile import _compiled, _cpu, _engine, _step_batch


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--preset", default="tiny-flash")
    p.add_argument("--sizes", default="1,2,4,8")
    p.add_argument("--context", type=int, default=512)
    p.add_argument("--rounds", type=int, default=16)
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--out")
    a = p.parse_args()

    import torch

    from flashlane.kernels import mhc
    from flashlane.kernels.native import mhc_weights

    eng = _engine(a.preset)
    sizes = tuple(int(s) for s in a.sizes.split(","))
    opaque = mhc_weights.weights_op
    graphs, warm_up = {}, {}
    # the backend looks the op up when a graph is traced: each set is traced with its own
    for way, fn in (("opaque_op", opaque), ("traced", mhc.hc_weights)):
        mhc_weights.weights_op = fn
        try:
            graphs[way] = _compiled(eng, sizes, "regional")
            w = graphs[way].warm_up()
        finally:
            mhc_weights.weights_op = opaque
        warm_up[way] = {"seconds": round(w.seconds, 1), "graphs": w.graphs}
    steps = []
    with torch.inference_mode():
        for size in sizes:
            batch = _step_batch(eng, graphs["opaque_op"], size, a.context)
            times = {way: [] for way in graphs}
            for r in range(a.rounds):
                for way in (list(graphs) if r % 2 == 0 else list(reversed(graphs))):
                    graphs[way].run(batch)   # settle
                    t0 = time.perf_counter()
                    for _ in range(a.reps):
                        graphs[way].run(batch)
                    times[way].append((time.perf_counter() - t0) / a.reps)
            ratio = [x / y for x, y in zip(times["opaque_op"], times["traced"])]
            steps.append({"size": size, "median_ms": {w: round(1e3 * statistics.median(t), 3) for w, t in times.items()},
                          "opaque_over_traced": {"median": round(statistics.median(ratio), 3),
                                                 "min": round(min(ratio), 3), "max": round(max(ratio), 3)}})
            print(steps[-1], flush=True)
    write_result("mhc_in_graph", {"cpu": _cpu(), "preset": a.preset, "dtype": "float32", "threads": torch.get_num_threads(),
                                  "context": a.context, "rounds": a.rounds, "reps": a.reps,
                                  "warm_up_in_one_process": warm_up, "step": steps}, a.out)


if __name__ == "__main__":
    main()
