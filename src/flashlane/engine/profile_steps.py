"""``flashlane profile``'s measurement: decode steps of B sequences at a given context, and one
prefill chunk, each under torch.profiler through the real engine (scheduler, cache, runner,
sampler), with the per-layer-type breakdown of ``engine.profiling``."""

from __future__ import annotations

import itertools
import json
import random
import time
from pathlib import Path

from ..machine import machine_info
from ..trace_ranges import profiling_range
from .llm_engine import LLMEngine
from .profiling import StepProfiler, breakdown, per_unit, write_trace
from .sampling_params import SamplingParams

WARMUP_STEPS = 2
_prefill_ids = itertools.count()


def _timed_step(engine: LLMEngine) -> float:
    t0 = time.perf_counter()
    with profiling_range("engine_step"):
        engine.step()
    return time.perf_counter() - t0


def _mean_ms(seconds: list[float]) -> float:
    return 1000 * sum(seconds) / len(seconds)


def _check(engine: LLMEngine, batch: int, context: int, steps: int, prefill_tokens: int) -> None:
    for name, v in (("batch", batch), ("context", context), ("steps", steps), ("prefill_tokens", prefill_tokens)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{name} must be an integer >= 1, got {v!r}")
    if batch > engine.info.max_running:
        raise ValueError(f"batch {batch} exceeds what the engine runs at once ({engine.info.max_running}: "
                         "raise max_num_seqs or the cache memory)")
    longest = context + WARMUP_STEPS + 2 * steps + 1
    if longest > engine.max_model_len:
        raise ValueError(f"context {context} plus {longest - context} profiled tokens exceeds max_model_len "
                         f"{engine.max_model_len}")
    if batch * longest > engine.info.num_tokens:
        raise ValueError(f"batch {batch} x {longest} tokens does not fit the cache "
                         f"({engine.info.num_tokens} tokens): lower batch or context, or raise the cache memory")
    if prefill_tokens >= engine.max_model_len:
        raise ValueError(f"prefill_tokens {prefill_tokens} must be below max_model_len {engine.max_model_len}")


def _profiled(engine: LLMEngine, run_steps, units: int | None = None) -> tuple[dict, object]:
    """``run_steps()`` (a list of step wall times) under the profiler: the breakdown per unit
    (default: per step) with the measured wall time beside it, and the profile."""
    window = StepProfiler()
    window.start()
    try:
        wall_s = run_steps()
    finally:
        prof = window.stop()
    summary = per_unit(breakdown(prof.events()), units)
    summary["ms_measured"] = 1000 * sum(wall_s) / (units or len(wall_s))   # wall clock around the steps
    return summary, prof


def _prefill(engine: LLMEngine, prompt: list[int]) -> list[float]:
    """Step one fresh request through its whole prefill (it stops after its first token; prefix
    caching may pause the prefill at a state checkpoint, making two steps) and abort it."""
    req = engine.add_request(f"profile-prefill-{next(_prefill_ids)}", prompt,
                             SamplingParams(max_tokens=1, temperature=0, ignore_eos=True))
    try:
        wall = []
        while not req.output_token_ids:
            wall.append(_timed_step(engine))
        return wall
    finally:
        engine.abort(req.request_id)


def profile_steps(engine: LLMEngine, batch: int, context: int, steps: int, prefill_tokens: int,
                  output_dir: str | Path, seed: int = 0) -> dict:
    """Profile ``steps`` decode steps of ``batch`` sequences at ``context`` tokens (per step), and
    the prefill of one fresh prompt of ``prefill_tokens`` tokens (per prompt). Writes
    ``trace_decode.json``, ``trace_prefill.json`` (Chrome / Perfetto traces) and ``profile.json``
    (the returned summary) under ``output_dir``."""
    _check(engine, batch, context, steps, prefill_tokens)
    out = Path(output_dir)
    rng = random.Random(seed)
    vocab = engine.config.vocab_size

    def prompt(n: int) -> list[int]:   # random ids: no prefix-cache hit between the prompts
        return [rng.randrange(1, vocab) for _ in range(n)]

    params = SamplingParams(max_tokens=WARMUP_STEPS + 2 * steps + 1, temperature=0, ignore_eos=True)
    reqs = [engine.add_request(f"profile-decode-{i}", prompt(context), params) for i in range(batch)]
    try:
        while any(not r.output_token_ids for r in reqs):   # prefill every sequence
            engine.step()
        for _ in range(WARMUP_STEPS):
            engine.step()
        unprofiled = [_timed_step(engine) for _ in range(steps)]
        decode, prof = _profiled(engine, lambda: [_timed_step(engine) for _ in range(steps)])
        decode["ms_unprofiled"] = _mean_ms(unprofiled)   # the same kind of step without the profiler
    finally:
        for r in reqs:
            engine.abort(r.request_id)
    traces = {"decode": str(write_trace(prof, out / "trace_decode.json"))}

    # a fresh prompt each time: the same one would hit the prefix cache
    unprofiled = _prefill(engine, prompt(prefill_tokens))
    prefill, prof = _profiled(engine, lambda: _prefill(engine, prompt(prefill_tokens)), units=1)
    prefill["ms_unprofiled"] = 1000 * sum(unprofiled)
    traces["prefill"] = str(write_trace(prof, out / "trace_prefill.json"))

    result = {
        "model": engine.model_name, "arch": engine.config.arch, "dtype": engine.info.dtype,
        "batch": batch, "context": context, "steps": steps, "prefill_tokens": prefill_tokens,
        "compile": engine.args.compile, "quantization": engine.args.quantization,
        "machine": machine_info(), "decode": decode, "prefill": prefill, "traces": traces,
    }
    (out / "profile.json").write_text(json.dumps(result, indent=2))
    return result


__all__ = ["profile_steps"]
