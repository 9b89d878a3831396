"""`flashlane calibrate MODEL`: fit the step-cost model of MODEL to this machine and engine mode.

Runs the engine over a small grid (prefill chunk size x concurrency x prompt length, each prompt
followed by two turns that extend it by a short and a longer message, so small and large prefill
chunks after a cached prefix are measured too, and a few decode steps of every batch; every
prompt is its own, see ``CALIBRATION_METHOD``), reads the engine's own step records, fits
``analyze.step_cost`` to their durations and writes the calibration JSON (machine, mode, grid,
coefficients, residuals). The residuals are also reported 2-fold cross-validated: the fit on every
other step predicts the steps it did not see.
"""

from __future__ import annotations

import argparse
import random
import sys
import time

from .engine_flags import add_engine_flags, apply_thread_default, engine_kwargs
from .help import HelpFormatter

DEFAULT_CHUNKS = (256, 2048)
DEFAULT_BATCHES = (1, 4, 8)
DEFAULT_CONTEXTS = (256, 1024, 4096)
QUICK = {"chunks": (256,), "batches": (1, 4), "contexts": (128, 512)}
FOLLOW_UP_TOKENS = (16, 256)
# what calibrate measures, versioned: a cached calibration of another method is made anew
# (2: the front end's contention waves; 3: the contention fitted per step kind). Prompts of a
# batch that shared a cached prefix would make long-context batches cheap to build (SmolLM2: 14
# min instead of over an hour), but their decode steps then read the same, cache-hot pages, and
# that fit priced served decode steps 16-36% low (measured), so every prompt is its own.
# 4: a warm-up of 64 decode steps and one full batch before the grid (``warm_up``).
# 5: the front end's server gets the same warm-up and its requests the grid's --decode-tokens.
# 6: the fit prices a prefill-carrying step's matmul rows as M + M0 (``step_cost``'s c_prefill_rows).
# 7: a speed probe (``simulate.speed_probe``) after each chunk size's grid; 8: the probe's fastest
# repeat (its version 2), not the median.
CALIBRATION_METHOD = 8


def _ints(value: str) -> tuple[int, ...]:
    try:
        out = tuple(int(v) for v in value.split(",") if v.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {value!r}") from None
    if not out or min(out) < 1:
        raise argparse.ArgumentTypeError(f"expected integers >= 1, got {value!r}")
    return out


def batch_contexts(contexts, batch: int, batch_tokens: int | None, longest: int) -> list[int]:
    """The prompt lengths a batch of ``batch`` prompts runs: each context capped by the model's
    longest and by ``batch_tokens / batch`` (never below the smallest context), without repeats."""
    cap = longest if batch_tokens is None else min(longest, max(batch_tokens // batch, min(contexts)))
    return sorted({min(c, cap) for c in contexts})


def add_parser(sub):
    p = sub.add_parser(
        "calibrate", formatter_class=HelpFormatter,
        help="fit the step-cost model (simulator) of a model to this machine and engine mode",
        description="Measures engine steps over a grid of prefill chunk sizes, concurrencies and prompt lengths, "
                    "fits t_step = t_host + sum_g c_g max(flops_g/peak, bytes_g/bw) + n_ops t_dispatch to the "
                    "engine's step records, prints the fit's residuals and writes the calibration JSON.")
    p.add_argument("model", help="preset, checkpoint folder or .gguf file")
    p.add_argument("--out", default=None, help="calibration file (default: calibration-<model>.json)")
    p.add_argument("--chunks", type=_ints, default=DEFAULT_CHUNKS,
                   help="prefill chunk sizes (--max-num-batched-tokens per engine)")
    p.add_argument("--batches", type=_ints, default=DEFAULT_BATCHES, help="requests run at once")
    p.add_argument("--contexts", type=_ints, default=DEFAULT_CONTEXTS, help="prompt lengths in tokens")
    p.add_argument("--batch-tokens", type=int, default=None,
                   help="cap on the prompt tokens of one batch: a batch of B runs each context c as "
                        "min(c, BATCH_TOKENS / B) (its decode steps still reach B x that context; prefilling "
                        "8 prompts of 8K tokens alone takes SmolLM2 on one slow core ~10 min); default no cap")
    p.add_argument("--decode-tokens", type=int, default=12, help="tokens generated per request")
    p.add_argument("--quick", action="store_true", help="a small grid (a smoke run; a poor fit)")
    p.add_argument("--no-front-end", action="store_true",
                   help="skip measuring the server's front end (a `flashlane serve` with these engine flags, "
                        "a dozen chat requests one at a time, then waves of the largest --batches at once: "
                        "admission, token delivery, the pause between steps and the served steps' slowdown); "
                        "a simulation then assumes none")
    p.add_argument("--front-end-only", metavar="CALIBRATION", default=None,
                   help="re-measure only the server's front end of an existing calibration of MODEL on this "
                        "machine (its engine mode and fitted step costs kept, the grid not run again) and write "
                        "the calibration with it to --out (a SmolLM2 grid takes half an hour on a slow core)")
    add_engine_flags(p)
    p.set_defaults(max_num_batched_tokens=None)
    return p


def _grid_steps(args, chunk: int, seed: int):
    """Run the grid at one chunk size in a fresh engine: its step records, the engine's info and
    the model config it ran."""
    from ..engine.llm import LLM
    from ..engine.sampling_params import SamplingParams

    kwargs = {**engine_kwargs(args), "max_num_batched_tokens": chunk}
    llm = LLM(args.model, **kwargs)
    rng = random.Random(seed)
    vocab = llm.engine.config.vocab_size
    params = SamplingParams(max_tokens=args.decode_tokens, temperature=0, ignore_eos=True)
    longest = llm.engine.max_model_len - (1 + len(FOLLOW_UP_TOKENS)) * args.decode_tokens - sum(FOLLOW_UP_TOKENS)
    try:
        warm_up(llm, rng, vocab, max(args.batches))
        llm.engine.step_stats.clear()
        for batch in args.batches:
            for ctx in batch_contexts(args.contexts, batch, args.batch_tokens, longest):
                prompts = [[rng.randrange(3, vocab) for _ in range(ctx)] for _ in range(batch)]
                outs = llm.generate(prompts, params)
                # the next turns: the prompt, the answer and a short then a longer new message, each
                # after a cached prefix (an agent's turns: small prefill chunks, the checkpointed
                # pieces of a hybrid's, cost far more per token than long ones)
                for extra in FOLLOW_UP_TOKENS:
                    prompts = [p + list(o.token_ids) + [rng.randrange(3, vocab) for _ in range(min(chunk, extra))]
                               for p, o in zip(prompts, outs)]
                    outs = llm.generate(prompts, params)
        return [r.to_json(with_ids=False) for r in llm.engine.step_stats], llm.engine.info.report(), llm.engine.config
    finally:
        llm.close()


def warm_up(llm, rng, vocab: int, batch: int) -> None:
    """Steps a fresh engine runs before the grid is measured. Its first few dozen decode steps run
    1.5x slower than later ones on tiny models (measured on tiny-standard: 36 ms against 23 ms for
    the same batch-1 step), and a grid started after one 2-token request fitted that start-up into
    every step's fixed cost; 64 decode steps and one batch of the largest size settle it."""
    from ..engine.sampling_params import SamplingParams

    llm.generate([[rng.randrange(3, vocab) for _ in range(64)]], SamplingParams(max_tokens=64, ignore_eos=True))
    llm.generate([[rng.randrange(3, vocab) for _ in range(64)] for _ in range(batch)],
                 SamplingParams(max_tokens=8, ignore_eos=True))


def _weight_dtype(info: dict) -> str:
    q = info.get("quantization")
    if q:
        return "int8"
    return "fp32" if info["dtype"] == "float32" else "bf16"


def _front_end(model: str, kwargs: dict, seed: int, concurrency: int, predict, output_tokens: int) -> dict:
    """The front end of `flashlane serve` with these engine arguments, measured on a server of its
    own with requests of the grid's length (``output_tokens``)."""
    from .. import presets
    from ..bench.text_synth import TextSynth, load_tokenizer
    from ..simulate.measure_front_end import measure_front_end
    from .engine_flags import flags_of_engine_kwargs

    synth = TextSynth(seed, load_tokenizer(model, presets.tokenizer_file) if presets.tokenizer_file(model) else None)
    return measure_front_end(model, flags_of_engine_kwargs(kwargs), synth,
                             log=lambda m: print(m, file=sys.stderr), predict=predict,
                             concurrency=concurrency, output_tokens=output_tokens).to_dict()


def _refresh_front_end(args) -> int:
    """``--front-end-only``: the calibration with its front end measured anew."""
    from dataclasses import replace

    from ..analyze.calibration import load_calibration
    from ..analyze.models import resolve_model
    from ..machine import machine_info

    try:
        cal, _ = load_calibration(args.front_end_only, machine=machine_info(), strict=True)
    except ValueError as exc:
        print(f"error: --front-end-only: {exc}", file=sys.stderr)
        return 2
    if cal.model != args.model:
        print(f"error: --front-end-only: the calibration is of {cal.model!r}, not {args.model!r}", file=sys.stderr)
        return 2
    if cal.mode.get("quantization"):
        print("error: --front-end-only: a quantized calibration records no quantization method; "
              "calibrate it in full", file=sys.stderr)
        return 2
    if cal.mode.get("speculative"):
        print("error: --front-end-only: a calibration with speculative decoding records no acceptance "
              "settings; calibrate it in full", file=sys.stderr)
        return 2
    t0 = time.monotonic()
    kwargs = {k: cal.mode[k] for k in ("dtype", "kv_cache_dtype", "compile", "kernel_backend", "num_threads",
                                       "linear_kernel") if cal.mode.get(k) is not None}
    if kwargs.get("kv_cache_dtype") == kwargs.get("dtype"):
        del kwargs["kv_cache_dtype"]        # recorded resolved: the model's dtype is the flag's "auto"
    predict = cal.cost_model(resolve_model(args.model).cfg).seconds
    front_end = _front_end(args.model, kwargs, args.seed, max(cal.grid.get("batches") or [1]), predict,
                           cal.grid.get("decode_tokens") or args.decode_tokens)
    # the grid keeps the method it was measured with; the front end is this method's
    cal = replace(cal, front_end=front_end, grid={**cal.grid, "front_end_method": CALIBRATION_METHOD},
                  notes=[*cal.notes, f"front end re-measured with calibration method {CALIBRATION_METHOD} on "
                                     f"{time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime())} in "
                                     f"{time.monotonic() - t0:.0f} s (--front-end-only {args.front_end_only})"])
    out = args.out or f"calibration-{str(args.model).replace('/', '_')}.json"
    cal.save(out)
    _print(cal, out)
    return 0


def run(args) -> int:
    if args.quick:
        args.chunks, args.batches, args.contexts = QUICK["chunks"], QUICK["batches"], QUICK["contexts"]
    if args.batch_tokens is not None and args.batch_tokens < 1:
        print("error: --batch-tokens must be >= 1", file=sys.stderr)
        return 2
    if args.decode_tokens < 2:
        print("error: --decode-tokens must be >= 2 (decode steps are part of the grid)", file=sys.stderr)
        return 2
    if args.front_end_only:
        if args.no_front_end:
            print("error: --front-end-only and --no-front-end contradict each other", file=sys.stderr)
            return 2
        return _refresh_front_end(args)
    apply_thread_default(args)   # before torch loads
    from ..analyze.calibration import Calibration
    from ..analyze.hardware import calibrate_local
    from ..analyze.step_cost import StepShape, StepWork, error_summary, fit
    from ..machine import machine_info
    from ..simulate.setup import speculative_mode
    from ..simulate.speed_probe import measure_speed

    t0 = time.monotonic()
    hw = calibrate_local()
    records, info, cfg, probes = [], None, None, []
    for i, chunk in enumerate(args.chunks):
        recs, info, cfg = _grid_steps(args, chunk, seed=args.seed + i)
        records += recs
        probes.append(measure_speed(info["dtype"], info.get("num_threads") or 1).to_dict())
    shapes = [StepShape.from_record(r) for r in records]
    seconds = [r["end"] - r["start"] for r in records]
    work = StepWork(cfg, _weight_dtype(info), "int8" if info["kv_cache_dtype"] == "int8" else "bf16",
                    graphs=bool(args.compile))
    peak, bw = hw.peak("bf16"), hw.mem_bw
    model, result = fit(work, shapes, seconds, peak, bw)
    # 2-fold cross-validation: each half predicted by the fit on the other
    halves = [(shapes[j::2], seconds[j::2]) for j in (0, 1)]
    held_out = []
    for j in (0, 1):
        m, _ = fit(work, *halves[1 - j], peak, bw)
        held_out.append(error_summary(m.seconds, *halves[j])["all"])
    front_end = None if args.no_front_end else _front_end(
        args.model, {**engine_kwargs(args), "dtype": info["dtype"], "num_threads": info.get("num_threads")},
        args.seed, max(args.batches), model.seconds, args.decode_tokens)
    mode = {"dtype": info["dtype"], "kv_cache_dtype": info["kv_cache_dtype"],
            "quantization": _weight_dtype(info) if info.get("quantization") else None,
            "compile": bool(args.compile), "kernel_backend": (info.get("kernel_backend") or {}).get("name"),
            "num_threads": info.get("num_threads"),
            "linear_kernel": (info.get("linear_kernel") or {}).get("format"),
            "speculative": speculative_mode(args.speculative_config)}
    cal = Calibration(
        model=args.model, machine=machine_info(), mode=mode, peak_flops=peak, mem_bw=bw,
        weight_dtype=_weight_dtype(info), kv_dtype="int8" if info["kv_cache_dtype"] == "int8" else "bf16",
        coefficients=model.coefficients,
        fit={**result.to_dict(), "by_kind": error_summary(model.seconds, shapes, seconds), "cross_validated": held_out},
        grid={"chunks": list(args.chunks), "batches": list(args.batches), "contexts": list(args.contexts),
              "batch_tokens": args.batch_tokens, "decode_tokens": args.decode_tokens, "steps": len(records),
              "method": CALIBRATION_METHOD},
        seconds=time.monotonic() - t0, front_end=front_end, speed_probes=probes,
        notes=[f"peak and bandwidth: {hw.note}", "t_step is the engine step's wall time (scheduling, model run, "
               "output processing) from its step records"])
    out = args.out or f"calibration-{str(args.model).replace('/', '_')}.json"
    cal.save(out)
    _print(cal, out)
    return 0


def _print(cal, out: str) -> None:
    from ..analyze.step_cost import prefill_m0

    m, f = cal.machine, cal.fit
    print(f"calibrated {cal.model} on {m['cpu_model']} ({m['cpu_capability']}), {cal.mode['dtype']}, "
          f"{'static-graph decode' if cal.mode['compile'] else 'eager'}, {cal.mode['num_threads']} threads: "
          f"{cal.grid['steps']} steps in {cal.seconds:.0f} s")
    print(f"  {'steps':<8} {'n':>5} {'median |err|':>13} {'p90 |err|':>10} {'measured s':>11} {'predicted s':>12}")
    for kind, s in f["by_kind"].items():
        print(f"  {kind:<8} {s['steps']:>5} {100 * s['median_rel_error']:>12.1f}% {100 * s['p90_rel_error']:>9.1f}% "
              f"{s['measured_s']:>11.2f} {s['predicted_s']:>12.2f}")
    cv = f["cross_validated"]
    print(f"  held out (2-fold): median |err| {100 * cv[0]['median_rel_error']:.1f}% / "
          f"{100 * cv[1]['median_rel_error']:.1f}%, p90 {100 * cv[0]['p90_rel_error']:.1f}% / "
          f"{100 * cv[1]['p90_rel_error']:.1f}%")
    print("  coefficients: " + ", ".join(f"{k} {v:.3g}" for k, v in cal.coefficients.items()))
    m0 = prefill_m0(cal.coefficients)
    print("  prefill chunks: " + ("the fit gave the weights' matmuls no cost (c_weights 0)" if m0 is None else
                                  f"the weights' matmuls of a step with M prefill rows cost M + {m0:.0f} rows "
                                  f"(M / (M + M0) of the large-M rate)"))
    fe = cal.front_end
    print("  front end: " + ("not measured (--no-front-end): a simulation assumes none" if fe is None else
                             f"admission {1e3 * fe['request_s']:.2f} ms + {1e6 * fe['per_prompt_token_s']:.2f} us/prompt "
                             f"token, token delivery {1e3 * fe['token_s']:.2f} ms, pause between steps "
                             f"{1e3 * fe['step_gap_s']:.2f} ms; served steps "
                             f"{fe.get('served_prefill_scale', 1.0):.3f}x (prefill) / "
                             f"{fe.get('served_decode_scale', 1.0):.3f}x (decode) the engine alone's, "
                             f"{fe.get('served_prefill_contention', 0.0):+.3f}x (prefill) / "
                             f"{fe.get('served_decode_contention', 0.0):+.3f}x (decode) per additional sequence "
                             f"(measured to {fe.get('served_contention_seqs', 1)})"))
    if cal.speed_probes:
        def ms(key: str, digits: int = 1) -> str:
            return ", ".join(f"{1e3 * x[key]:.{digits}f}" for x in cal.speed_probes)
        print(f"  speed probes ({len(cal.speed_probes)}): matmul {ms('compute_s')} ms, weight read "
              f"{ms('memory_s')} ms, host {ms('host_s', 2)} ms")
    print(f"written to {out}")
