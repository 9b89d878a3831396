"""Regional vs whole-model compilation of the static-graph decode (issue 22).

``cold``: one fresh process per (preset, mode, buckets) with an empty Inductor cache: the warm-up
seconds (wall and CPU) and the number of compiled graphs. ``step``: both modes compiled in one
process and timed interleaved (paired rounds, A/B order alternating) on the same padded decode
batch, so the neighbours' load moves both alike; the answer is the per-round ratio.

    python benchmarks/regional_compile.py [--presets tiny-flash,tiny-standard] [--out PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time

from common import write_result

MODES = ("whole", "regional")


def _cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return sum(x.ru_utime + x.ru_stime for x in r)


def _engine(preset: str):
    from flashlane.engine.llm import LLM

    # the linears as an engine with --compile lays them out (a timed oneDNN-packed format is not traced)
    return LLM(preset, dtype="float32", max_num_seqs=16, enable_prefix_caching=False, linear_kernel="aten").engine


def _compiled(eng, sizes, mode: str):
    from flashlane.engine.compiled_decode import CompiledDecode

    page = eng.cache.tensors.spec.page_size
    return CompiledDecode(eng.model, eng.cache.tensors, sizes, eng.args.index_topk,
                          min_width=-(-(eng.index_topk or 0) // page), ops=eng.ops, regional=mode == "regional")


def cold(preset: str, mode: str, sizes: tuple[int, ...]) -> dict:
    """Run in a fresh process (see main): compile every bucket from an empty cache."""
    import torch

    eng = _engine(preset)
    cd = _compiled(eng, sizes, mode)
    cpu0 = _cpu_s()
    w = cd.warm_up()
    return {"preset": preset, "mode": mode, "sizes": list(sizes), "warmup_s": round(w.seconds, 1),
            "warmup_cpu_s": round(_cpu_s() - cpu0, 1), "graphs": w.graphs, "kinds": cd.num_kinds,
            "layers": len([m for m in eng.model.modules() if hasattr(m, "takes_selection")]),
            "threads": torch.get_num_threads()}


def _step_batch(eng, cd, size: int, context: int):
    """A decode step of ``size`` sequences at position ``context`` on distinct pages and slots."""
    page = eng.cache.tensors.spec.page_size
    pages = -(-(context + 1) // page)
    tables = [list(range(1 + b * pages, 1 + (b + 1) * pages)) for b in range(size)]
    return cd.batch([5] * size, [context] * size, tables, list(range(1, size + 1)))


def step(preset: str, size: int, context: int, rounds: int, reps: int) -> dict:
    import torch

    eng = _engine(preset)
    cds = {m: _compiled(eng, (size,), m) for m in MODES}
    for cd in cds.values():
        cd.warm_up()
    times = {m: [] for m in (*MODES, "eager")}
    runs = {"whole": cds["whole"].run, "regional": cds["regional"].run, "eager": eng.model}
    with torch.inference_mode():   # as the engine's runner: the graphs were traced on inference tensors
        batch = _step_batch(eng, cds["whole"], size, context)
        for r in range(rounds):
            order = list(runs) if r % 2 == 0 else list(reversed(runs))
            for m in order:
                runs[m](batch)   # settle
                t0 = time.perf_counter()
                for _ in range(reps):
                    runs[m](batch)
                times[m].append((time.perf_counter() - t0) / reps)
    ratio = [a / b for a, b in zip(times["regional"], times["whole"])]
    return {"preset": preset, "size": size, "context": context, "rounds": rounds, "reps": reps,
            "median_ms": {m: round(1e3 * statistics.median(t), 3) for m, t in times.items()},
            "regional_over_whole": {"median": round(statistics.median(ratio), 3),
                                    "min": round(min(ratio), 3), "max": round(max(ratio), 3)},
            "eager_over_whole": round(statistics.median(a / b for a, b in zip(times["eager"], times["whole"])), 3)}


def _fresh(args: list[str], compile_threads: str = "1") -> dict:
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=tempfile.mkdtemp(prefix="flashlane-regional-"))
    if compile_threads == "auto":   # Inductor's own choice, as the engine runs (its workers' CPU time is not counted)
        env.pop("TORCHINDUCTOR_COMPILE_THREADS", None)
    else:                           # "1": compile in-process, so its CPU time is counted
        env["TORCHINDUCTOR_COMPILE_THREADS"] = compile_threads
    out = subprocess.run([sys.executable, __file__, *args], env=env, capture_output=True, text=True)
    if out.returncode:
        raise RuntimeError(f"{args} exited with {out.returncode}:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def _cpu() -> dict:
    import torch

    with open("/proc/cpuinfo") as f:
        model = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "unknown")
    return {"capability": torch.backends.cpu.get_cpu_capability(), "model_name": model, "cores": os.cpu_count(),
            "load_avg_at_start": os.getloadavg()}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--presets", default="tiny-flash,tiny-standard")
    p.add_argument("--modes", default="whole,regional")
    p.add_argument("--sizes", default="4;1,2,4,8,16", help="bucket sets for the cold runs, ';'-separated")
    p.add_argument("--step-size", type=int, default=4)
    p.add_argument("--context", type=int, default=512)
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--skip-step", action="store_true")
    p.add_argument("--compile-threads", default="1", help="Inductor's compile threads in the cold runs: a number, or "
                                                          "auto (its default, as the engine runs)")
    p.add_argument("--out")
    p.add_argument("--_cold", nargs=3, help=argparse.SUPPRESS)
    p.add_argument("--_step", nargs=1, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a._cold:
        print(json.dumps(cold(a._cold[0], a._cold[1], tuple(int(s) for s in a._cold[2].split(",")))))
        return
    if a._step:
        print(json.dumps(step(a._step[0], a.step_size, a.context, a.rounds, a.reps)))
        return
    result = {"cpu": _cpu(), "compile_threads": a.compile_threads, "cold": [], "step": []}
    for preset in a.presets.split(","):
        for sizes in a.sizes.split(";"):
            for mode in a.modes.split(","):
                result["cold"].append(_fresh(["--_cold", preset, mode, sizes], a.compile_threads))
                print(json.dumps(result["cold"][-1]), file=sys.stderr)
        if not a.skip_step:
            result["step"].append(_fresh(["--_step", preset, "--step-size", str(a.step_size), "--context",
                                          str(a.context), "--rounds", str(a.rounds), "--reps", str(a.reps)]))
            print(json.dumps(result["step"][-1]), file=sys.stderr)
    write_result("regional_compile", result, a.out)


if __name__ == "__main__":
    main()
