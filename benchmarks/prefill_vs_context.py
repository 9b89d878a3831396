"""Prefill tokens/s vs context length (issue 22): flashlane against transformers' forward, against
the FLOP roofline and, with ``--baseline-src``, against another source tree ("today's").

For each model and context L, one L-token prompt is prefilled:

* flashlane: ``LLMEngine`` with prefix caching off, the engine's default chunked prefill, and
  ``max_tokens=1``; timed by the engine's own step records (sum of step durations, "engine") and
  by wall-clock around submit-to-finish ("wall");
* transformers: one ``model(input_ids, use_cache=False, logits_to_keep=1)`` (only the last
  token's logits, as the engine computes), wall-clock;
* roofline: ``analyze.prefill_flops`` of the L-token prefill over a matmul peak measured in this
  run for the dtype used (best of a large torch matmul; bf16 where the CPU has native bf16),
  and over ``analyze``'s calibrated ``local`` profile (numpy fp32) for reference.

Every measurement is one warm-up then the best of ``--repeats``, in a fresh worker process
(``--worker``) with the same torch threads and dtype, that prints one JSON line. Baseline
workers run this same file with PYTHONPATH=<baseline src>; baseline and current alternate
(A B, then B A, ...) from one (model, context) to the next so drift hits both. A side that fails,
runs out of ``--max-side-gb`` or would exceed ``--max-side-s`` is recorded as skipped with why.

Ratios: current/baseline on engine time; current/transformers on wall-clock (the same span on
both sides); roofline fractions on engine time. ``goals`` evaluates the issue's goals.

    python benchmarks/prefill_vs_context.py --baseline-src /path/to/worktree-of-old-commit
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

# No flashlane, torch or common import at module level: a baseline worker runs this file with
# another tree on PYTHONPATH, and common.py would put this tree's src/ in front of it.

HERE = Path(__file__).resolve()
REPO = HERE.parents[1]

DEFAULT_MODELS = "tiny-flash,tiny-standard,smollm2-135m"
DEFAULT_CONTEXTS = "1024,4096,8192,16384"
GOAL_CONTEXT = 8192               # the tiny models' speed goals are at 8K
SPEEDUP_VS_BASELINE = 4.0         # tiny models at 8K: >= 4x today's
SPEEDUP_VS_TRANSFORMERS = 3.0     # tiny models at 8K: >= 3x transformers
PER_TOKEN_GROWTH_MAX = 1.5        # tiny-standard: per-token prefill time 16K / 4K
PER_TOKEN_CONTEXTS = (4096, 16384)
PEAK_FRACTION_MIN = 0.75          # smollm2: >= 75% of the matmul peak of its dtype
TINY_MODELS = ("tiny-flash", "tiny-standard")
SPARSE_MODEL = "tiny-standard"
DENSE_MODEL = "smollm2-135m"
PEAK_SIZES = (1024, 2048)         # square matmuls timed for the peak (2 and 17 GFLOP per call)
PEAK_REPS = 8
CACHE_MEMORY = 2 * 1024 ** 3


# ---- pure helpers (unit-tested) --------------------------------------------------------------

def abba_order(keys: list, sides: tuple[str, str] = ("baseline", "current")) -> list[tuple[object, str]]:
    """(key, side) in run order: both sides per key, their order flipped on every other key
    (A B, B A, A B ...), so a slow drift of the machine lands on both alike."""
    out = []
    for i, key in enumerate(keys):
        for side in (sides if i % 2 == 0 else sides[::-1]):
            out.append((key, side))
    return out


def roofline(flops: float, peak_flops: float, context: int, tok_s: float | None) -> dict:
    """The FLOP-bound prefill rate of a ``context``-token prompt costing ``flops`` at
    ``peak_flops``, and the share of it that ``tok_s`` reaches."""
    roof = context * peak_flops / flops
    return {"flops": flops, "peak_flops": peak_flops, "tok_s": roof,
            "fraction": None if tok_s is None else tok_s / roof}


def tok_s(side: dict | None, key: str) -> float | None:
    """Tokens/s of a measured side (``key``: engine_tok_s, wall_tok_s, tok_s), None if skipped."""
    if not side or side.get("skipped"):
        return None
    return side.get(key)


def ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None or b == 0 else a / b


def per_token_growth(rows: list[dict], model: str, lo: int = PER_TOKEN_CONTEXTS[0],
                     hi: int = PER_TOKEN_CONTEXTS[1]) -> float | None:
    """(time per prefilled token at ``hi``) / (at ``lo``) for ``model``'s current flashlane side
    (engine time); 1.0 is perfectly linear prefill, hi/lo is quadratic. None if either is missing."""
    rate = {r["context"]: tok_s(r.get("flashlane"), "engine_tok_s") for r in rows if r["model"] == model}
    if rate.get(lo) is None or rate.get(hi) is None:
        return None
    return rate[lo] / rate[hi]


def _goal(name: str, value: float | None, op: str, bar: float, numbers: dict, missing: str = "") -> dict:
    if value is None:
        return {"goal": name, "pass": None, "value": None, "bar": f"{op} {bar}", "numbers": numbers,
                "why": missing or "not measured"}
    ok = value >= bar if op == ">=" else value <= bar
    return {"goal": name, "pass": ok, "value": value, "bar": f"{op} {bar}", "numbers": numbers}


def evaluate_goals(rows: list[dict]) -> list[dict]:
    """The issue's goals over the result rows; ``pass`` is None where a needed side is missing
    (no --baseline-src, a skipped side, a model or context not run)."""
    by = {(r["model"], r["context"]): r for r in rows}
    goals = []
    for m in TINY_MODELS:
        r = by.get((m, GOAL_CONTEXT), {})
        goals.append(_goal(f"{m} prefill at {GOAL_CONTEXT} >= {SPEEDUP_VS_BASELINE:g}x today's",
                           r.get("speedup_vs_baseline"), ">=", SPEEDUP_VS_BASELINE,
                           {"current_tok_s": tok_s(r.get("flashlane"), "engine_tok_s"),
                            "baseline_tok_s": tok_s(r.get("baseline"), "engine_tok_s")},
                           "no baseline (--baseline-src) or a side skipped" if r else "not run"))
        goals.append(_goal(f"{m} prefill at {GOAL_CONTEXT} >= {SPEEDUP_VS_TRANSFORMERS:g}x transformers",
                           r.get("speedup_vs_transformers"), ">=", SPEEDUP_VS_TRANSFORMERS,
                           {"current_wall_tok_s": tok_s(r.get("flashlane"), "wall_tok_s"),
                            "transformers_tok_s": tok_s(r.get("transformers"), "tok_s")},
                           "a side skipped" if r else "not run"))
    lo, hi = PER_TOKEN_CONTEXTS
    goals.append(_goal(f"{SPARSE_MODEL} prefill time per token {hi} / {lo} <= {PER_TOKEN_GROWTH_MAX}",
                       per_token_growth(rows, SPARSE_MODEL), "<=", PER_TOKEN_GROWTH_MAX,
                       {str(c): tok_s(by.get((SPARSE_MODEL, c), {}).get("flashlane"), "engine_tok_s")
                        for c in (lo, hi)}))
    dense = sorted((r for r in rows if r["model"] == DENSE_MODEL), key=lambda r: r["context"])
    vs_base = {r["context"]: r.get("speedup_vs_baseline") for r in dense}
    goals.append(_goal(f"{DENSE_MODEL} prefill no slower than today (every context)",
                       None if not dense or None in vs_base.values() else min(vs_base.values()), ">=", 1.0,
                       {str(c): v for c, v in vs_base.items()},
                       "no baseline (--baseline-src) or a side skipped" if dense else "not run"))
    frac = {r["context"]: (r.get("roofline") or {}).get("fraction") for r in dense}
    dtype = dense[0].get("dtype") if dense else None
    whose = f"the {dtype}" if dtype else "its dtype's"
    goals.append(_goal(f"{DENSE_MODEL} prefill >= {PEAK_FRACTION_MIN:.0%} of {whose} matmul peak (every context)",
                       None if not dense or None in frac.values() else min(frac.values()), ">=",
                       PEAK_FRACTION_MIN, {str(c): v for c, v in frac.items()},
                       "a side skipped" if dense else "not run"))
    return goals


def make_row(model: str, context: int, dtype: str, sides: dict, flops: float, peak: float,
             local_peak: float | None) -> dict:
    """One result row from the measured sides (flashlane, baseline, transformers; any may be a
    ``{"skipped": why}`` or absent)."""
    cur, base, hf = sides.get("flashlane"), sides.get("baseline"), sides.get("transformers")
    eng = tok_s(cur, "engine_tok_s")
    row = {"model": model, "context": context, "dtype": dtype, "flashlane": cur, "baseline": base,
           "transformers": hf,
           "speedup_vs_baseline": ratio(eng, tok_s(base, "engine_tok_s")),
           "speedup_vs_transformers": ratio(tok_s(cur, "wall_tok_s"), tok_s(hf, "tok_s")),
           "roofline": roofline(flops, peak, context, eng)}
    row["roofline"]["baseline_fraction"] = roofline(flops, peak, context, tok_s(base, "engine_tok_s"))["fraction"]
    if local_peak:
        loc = roofline(flops, local_peak, context, eng)
        row["roofline"].update(local_profile_tok_s=loc["tok_s"], local_profile_fraction=loc["fraction"])
    return row


def _fmt(x: float | None, spec: str = ".0f") -> str:
    return "-" if x is None else format(x, spec)


def table(rows: list[dict]) -> str:
    head = (f"{'model':<14}{'ctx':>6}{'eng tok/s':>11}{'wall tok/s':>11}{'base':>9}{'x base':>8}"
            f"{'hf tok/s':>10}{'x hf':>7}{'roof':>8}")
    lines = [head]
    for r in rows:
        lines.append(f"{r['model']:<14}{r['context']:>6}{_fmt(tok_s(r['flashlane'], 'engine_tok_s')):>11}"
                     f"{_fmt(tok_s(r['flashlane'], 'wall_tok_s')):>11}{_fmt(tok_s(r['baseline'], 'engine_tok_s')):>9}"
                     f"{_fmt(r['speedup_vs_baseline'], '.2f'):>8}{_fmt(tok_s(r['transformers'], 'tok_s')):>10}"
                     f"{_fmt(r['speedup_vs_transformers'], '.2f'):>7}{_fmt(r['roofline']['fraction'], '.0%'):>8}")
    return "\n".join(lines)


# ---- workers (one measurement per process) ---------------------------------------------------

def _prompt(vocab: int, n: int) -> list[int]:
    v = min(vocab, 30000)
    return [(7 + 31 * i) % (v - 10) + 10 for i in range(n)]


def _limit_memory(gb: float) -> None:
    """Cap the worker's address space, so a side that would need too much memory fails with an
    allocation error (recorded as skipped) instead of pushing a shared machine into the OOM killer."""
    import resource

    if gb > 0:
        cap = int(gb * 1024 ** 3)
        resource.setrlimit(resource.RLIMIT_AS, (cap, cap))


def _repeat(fn, repeats: int, max_s: float, t_start: float) -> dict:
    """Warm-up, then ``repeats`` timed calls of ``fn`` (each returns a dict of timings), fewer if
    the warm-up's duration says they would run past ``max_s`` from ``t_start``; skipped if not
    even one fits."""
    t = time.perf_counter()
    fn()
    warm = time.perf_counter() - t
    fit = int((max_s - (time.perf_counter() - t_start)) // warm) if warm > 0 else repeats
    if fit < 1:
        return {"skipped": f"warm-up took {warm:.1f} s: one more run would pass --max-side-s {max_s:g}",
                "warmup_s": warm}
    runs = [fn() for _ in range(min(repeats, fit))]
    return {"runs": runs, "repeats_done": len(runs), "warmup_s": warm}


def _worker_flashlane(spec: dict) -> dict:
    import torch

    import flashlane
    from flashlane import SamplingParams
    from flashlane.engine.llm_engine import LLMEngine

    where = Path(flashlane.__file__).resolve()
    if spec.get("src") and not where.is_relative_to(Path(spec["src"]).resolve()):
        raise RuntimeError(f"imported flashlane from {where}, not from {spec['src']}")
    t_start = time.perf_counter()
    L = spec["context"]
    eng = LLMEngine(spec["model"], dtype=spec["dtype"], enable_prefix_caching=False, max_num_seqs=1,
                    max_model_len=L + 16, cache_memory=CACHE_MEMORY, skip_tokenizer_init=True)
    prompt = _prompt(eng.config.vocab_size, L)
    params = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    log = getattr(eng, "step_stats", None)
    n = [0]

    def once() -> dict:
        n[0] += 1
        if log is not None:
            log.clear()
        t = time.perf_counter()
        eng.add_request(f"p{n[0]}", prompt, params)
        while eng.has_unfinished():
            eng.step()
        wall = time.perf_counter() - t
        recs = list(log) if log is not None else []
        if recs and sum(r.prefill_tokens for r in recs) != L:
            raise RuntimeError(f"steps prefilled {sum(r.prefill_tokens for r in recs)} tokens, not {L}")
        return {"wall_s": wall, "engine_s": sum(r.duration for r in recs) if recs else None,
                "model_s": sum(r.model_s for r in recs) if recs else None, "steps": len(recs),
                "chunk": max((r.prefill_tokens for r in recs), default=None)}

    out = _repeat(once, spec["repeats"], spec["max_side_s"], t_start)
    out.update(flashlane_path=str(where.parent), threads=torch.get_num_threads(),
               dtype=str(eng.dtype).replace("torch.", ""),
               max_num_batched_tokens=eng.args.max_num_batched_tokens)
    if "runs" in out:
        runs = out["runs"]
        best_wall = min(r["wall_s"] for r in runs)
        engine = [r["engine_s"] for r in runs if r["engine_s"] is not None]
        best_eng = min(engine) if engine else best_wall     # a tree without step records: wall
        out.update(wall_s=best_wall, engine_s=best_eng, wall_tok_s=L / best_wall, engine_tok_s=L / best_eng,
                   steps=runs[0]["steps"], chunk=runs[0]["chunk"])
    if hasattr(eng, "close"):
        eng.close()
    return out


def _worker_transformers(spec: dict) -> dict:
    import torch
    from vs_transformers import hf_model  # transformers' model on flashlane's weights

    from flashlane.models.registry import load_model

    t_start = time.perf_counter()
    L = spec["context"]
    dtype = getattr(torch, spec["dtype"])
    loaded = load_model(spec["model"], dtype=spec["dtype"], require_tokenizer=False)
    model = hf_model(loaded, dtype)
    ids = torch.tensor([_prompt(loaded.config.vocab_size, L)])
    del loaded

    def once() -> dict:
        with torch.inference_mode():
            t = time.perf_counter()
            model(ids, use_cache=False, logits_to_keep=1)
            return {"wall_s": time.perf_counter() - t}

    out = _repeat(once, spec["repeats"], spec["max_side_s"], t_start)
    out.update(threads=torch.get_num_threads(), dtype=spec["dtype"],
               attn_implementation=getattr(model.config, "_attn_implementation", None))
    if "runs" in out:
        best = min(r["wall_s"] for r in out["runs"])
        out.update(wall_s=best, tok_s=L / best)
    return out


def _worker_peak(spec: dict) -> dict:
    """Best-of square-matmul FLOP/s over ``PEAK_SIZES`` in fp32 and, where the CPU has native bf16,
    in bf16 (the best size of each dtype is its peak)."""
    import torch

    from flashlane.kernels.cpu_caps import detect_cpu_caps

    dtypes = ["float32"] + (["bfloat16"] if detect_cpu_caps().native_bf16 else [])
    by_size: dict = {}
    with torch.inference_mode():
        for name in dtypes:
            for n in PEAK_SIZES:
                g = torch.Generator().manual_seed(0)
                a = torch.randn(n, n, generator=g).to(getattr(torch, name))
                b = torch.randn(n, n, generator=g).to(getattr(torch, name))
                a @ b
                best = float("inf")
                for _ in range(PEAK_REPS):
                    t = time.perf_counter()
                    a @ b
                    best = min(best, time.perf_counter() - t)
                by_size.setdefault(name, {})[str(n)] = 2 * n ** 3 / best
    return {"peak_flops": {k: max(v.values()) for k, v in by_size.items()}, "by_size": by_size,
            "reps": PEAK_REPS, "threads": torch.get_num_threads()}


WORKERS = {"flashlane": _worker_flashlane, "transformers": _worker_transformers, "peak": _worker_peak}


def worker_main(spec: dict) -> None:
    _limit_memory(spec.get("max_side_gb", 0))
    import torch

    torch.set_num_threads(spec["threads"])
    try:
        out = WORKERS[spec["kind"]](spec)
    except Exception as exc:  # noqa: BLE001 -- any failure of a side is a result: skipped, with why
        out = {"skipped": f"{type(exc).__name__}: {str(exc)[:300]}"}
    print(json.dumps(out), flush=True)


# ---- orchestrator ----------------------------------------------------------------------------

def src_dir(tree: Path) -> Path:
    return tree / "src" if (tree / "src" / "flashlane").is_dir() else tree


def run_worker(spec: dict, src: Path, timeout_s: float) -> dict:
    """One measurement in a fresh interpreter with ``src`` first on the import path."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(src), str(HERE.parent)]),
           "OMP_NUM_THREADS": str(spec["threads"])}
    t = time.perf_counter()
    try:
        cmd = [sys.executable, str(HERE), "--worker", json.dumps({**spec, "src": str(src)})]
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout_s, check=False)
    except subprocess.TimeoutExpired:
        return {"skipped": f"ran past --max-side-s {timeout_s:g}", "elapsed_s": time.perf_counter() - t}
    elapsed = time.perf_counter() - t
    for line in reversed(proc.stdout.strip().splitlines()):
        try:
            out = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(out, dict):
            out["elapsed_s"] = elapsed
            return out
    tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
    return {"skipped": f"worker exited {proc.returncode} without a result: {' | '.join(tail)[:300]}",
            "elapsed_s": elapsed}


def resolve_dtype(dtype: str) -> tuple[str, str]:
    """``auto`` resolved once (this tree's rule) and passed explicitly to every side."""
    if dtype != "auto":
        return dtype, "given"
    from flashlane.models.loader import auto_cpu_dtype_choice

    choice = auto_cpu_dtype_choice()
    return choice.dtype, choice.why


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default=DEFAULT_MODELS)
    ap.add_argument("--contexts", default=DEFAULT_CONTEXTS)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    ap.add_argument("--threads", type=int, default=None, help="torch threads on every side (default: torch's)")
    ap.add_argument("--baseline-src", help="another source tree (repo root or its src/) measured as 'today's'")
    ap.add_argument("--max-side-s", type=float, default=300.0,
                    help="a side (load, warm-up and repeats) taking longer is recorded as skipped")
    ap.add_argument("--max-side-gb", type=float, default=10.0,
                    help="address-space cap of a worker (0: none); running out is recorded as skipped")
    ap.add_argument("--no-transformers", action="store_true")
    ap.add_argument("--out")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker_main(json.loads(args.worker))
        return

    import torch
    from common import write_result

    from flashlane.analyze import prefill_flops, resolve_model
    from flashlane.analyze.hardware import calibrate_local

    t0 = time.perf_counter()
    models = args.models.split(",")
    contexts = sorted(int(c) for c in args.contexts.split(","))
    threads = args.threads or torch.get_num_threads()
    dtype, dtype_why = resolve_dtype(args.dtype)
    current = src_dir(REPO)
    baseline = src_dir(Path(args.baseline_src).resolve()) if args.baseline_src else None
    base = {"threads": threads, "dtype": dtype, "repeats": args.repeats, "max_side_s": args.max_side_s,
            "max_side_gb": args.max_side_gb}
    peak_timeout = 120.0

    peaks_before = run_worker({**base, "kind": "peak"}, current, peak_timeout)
    try:
        local = calibrate_local()
        local_peak = local.peak("bf16")
    except ValueError as exc:
        local, local_peak = None, None
        print(f"analyze local calibration failed: {exc}", flush=True)

    keys = [(m, c) for m in models for c in contexts]
    order = abba_order(keys) if baseline else [(k, "current") for k in keys]
    measured: dict = {k: {} for k in keys}
    too_slow: dict = {}     # (model, side) -> why it ran out of time at a smaller context

    def measure(key, side: str, kind: str, src: Path) -> None:
        m, c = key
        if (m, side) in too_slow:
            out = {"skipped": too_slow[(m, side)]}
        else:
            out = run_worker({**base, "kind": kind, "model": m, "context": c}, src, args.max_side_s)
            if "--max-side-s" in out.get("skipped", ""):     # longer prompts take longer still
                too_slow[(m, side)] = f"ran out of time at context {c}: {out['skipped']}"
        measured[key][side] = out
        print(m, c, side, _brief(out), flush=True)

    for i, (key, side) in enumerate(order):
        if side == "current":
            measure(key, "flashlane", "flashlane", current)
        else:
            measure(key, "baseline", "flashlane", baseline)
        last_of_key = i + 1 == len(order) or order[i + 1][0] != key
        if last_of_key and not args.no_transformers:
            measure(key, "transformers", "transformers", current)
    peaks_after = run_worker({**base, "kind": "peak"}, current, peak_timeout)

    # the best of the two peak measurements (before and after): a peak, not a typical rate
    peaks = {}
    for p in (peaks_before, peaks_after):
        for k, v in (p.get("peak_flops") or {}).items():
            peaks[k] = max(peaks.get(k, 0.0), v)
    peak = peaks.get(dtype)
    if peak is None:
        raise SystemExit(f"no {dtype} matmul peak measured: {peaks_before} {peaks_after}")

    rows = [make_row(m, c, dtype, measured[(m, c)], prefill_flops(resolve_model(m).cfg, c).total, peak, local_peak)
            for m, c in keys]
    result = {
        "models": models, "contexts": contexts, "dtype": dtype, "dtype_why": dtype_why, "threads": threads,
        "repeats": args.repeats, "max_side_s": args.max_side_s, "max_side_gb": args.max_side_gb,
        "current_src": str(current), "baseline_src": str(baseline) if baseline else None,
        "run_order": [[m, c, s] for (m, c), s in order],
        "matmul_peak": {"flops": peaks, "before": peaks_before, "after": peaks_after},
        "analyze_local_profile": local.to_dict() if local else None,
        "rows": rows,
        "per_token_growth": {m: {"contexts": list(PER_TOKEN_CONTEXTS), "ratio": per_token_growth(rows, m)}
                             for m in models},
        "goals": evaluate_goals(rows),
        "elapsed_s": time.perf_counter() - t0,
    }
    write_result("prefill_vs_context", result, args.out)
    print(table(rows))
    for g in result["goals"]:
        verdict = {True: "PASS", False: "FAIL", None: "n/a "}[g["pass"]]
        print(f"{verdict} {g['goal']}: {_fmt(g['value'], '.3g')} {g.get('why', '')}")
    print(f"elapsed {result['elapsed_s']:.0f} s")


def _brief(side: dict) -> str:
    if side.get("skipped"):
        return f"skipped: {side['skipped']}"
    keys = ("engine_tok_s", "wall_tok_s", "tok_s", "chunk", "steps", "elapsed_s")
    return " ".join(f"{k}={side[k]:.1f}" if isinstance(side[k], float) else f"{k}={side[k]}"
                    for k in keys if k in side)


if __name__ == "__main__":
    main()
