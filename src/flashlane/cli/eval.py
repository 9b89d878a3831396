"""`flashlane eval MODEL [engine options]`: accuracy against an fp32 reference run, beside speed
and memory, for one configuration or a sweep of them."""

from __future__ import annotations

import argparse
import json
import sys
import time

from .engine_flags import add_engine_flags, apply_thread_default, engine_kwargs
from .help import HelpFormatter

DESCRIPTION = """\
Runs the engine offline twice or more on the same text: a reference (the same model, float32,
no quantisation, kv_cache_dtype auto, the config's index_topk) and each configuration (the
engine options given here, or every point of --sweep), and reports per configuration:
  perplexity   the corpus tokenised whole (no special tokens), cut into consecutive
               non-overlapping windows of --window tokens (at most --max-windows); tokens
               2..N of each window scored given the tokens before them in that window;
               exp(mean NLL over all scored tokens)
  agreement    next-token top-1 agreement, mean and p99 KL(reference || configuration) over
               the same positions; greedy continuations of --greedy-prompts corpus prompts,
               --greedy-tokens each: 'prefix' = matching tokens up to the first divergence,
               'positionwise' = matching positions (fractions, averaged over prompts)
  cost         weight bytes, cache bytes per token, prefill tok/s, decode tok/s at batch 1
               and 16 (from the engine's step records, in the same run)
Random-weight models (tiny-flash, tiny-standard): only agreement and KL mean anything.
Prefix caching is off in every run (each scored position must be computed)."""


class _Formatter(HelpFormatter):
    def _fill_text(self, text, width, indent):   # the description is laid out by hand
        return "".join(indent + line for line in text.splitlines(keepends=True))


def _positive(value: str) -> int:
    try:
        v = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value!r}") from None
    if v < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {v}")
    return v


def add_parser(sub):
    p = sub.add_parser("eval", help="accuracy vs speed vs memory of engine options, against an fp32 reference",
                       description=DESCRIPTION, formatter_class=_Formatter)
    p.add_argument("model", metavar="MODEL", help="preset, checkpoint folder or .gguf file (also the reference)")
    p.add_argument("--candidate-model", default=None, metavar="DIR",
                   help="evaluate this checkpoint (same tokenizer, e.g. a pruned model) against MODEL's reference")
    p.add_argument("--corpus", default=None, metavar="FILE",
                   help="plain text, or JSONL (.jsonl) with a 'text' field per line "
                        "(default: Python's pydoc_data.topics, topics joined in sorted key order)")
    p.add_argument("--window", type=_positive, default=512, help="tokens per perplexity window")
    p.add_argument("--max-windows", type=_positive, default=8, help="windows scored at most (bounds the run)")
    p.add_argument("--greedy-prompts", type=int, default=8, help="prompts for greedy-continuation agreement (0: off)")
    p.add_argument("--greedy-prompt-len", type=_positive, default=64, help="corpus tokens per greedy prompt")
    p.add_argument("--greedy-tokens", type=_positive, default=32, help="greedy tokens generated per prompt")
    p.add_argument("--decode-tokens", type=_positive, default=32, help="tokens per sequence in the decode-speed runs")
    p.add_argument("--no-speed", action="store_true", help="skip the prefill/decode speed runs")
    p.add_argument("--sweep", default=None, metavar="SPEC",
                   help="a grid 'quantization=none,int8;kv_cache_dtype=auto,int8' (engine option names, "
                        "'model' for another checkpoint; 'none' = None) or a .json file with a list of "
                        "option objects; each point overrides the engine options given here")
    p.add_argument("--json", action="store_true", help="print the full result (reference and every "
                   "configuration) as JSON on stdout")
    p.add_argument("--output-dir", default=None, metavar="DIR",
                   help="write eval.json, eval.md and eval.html (Pareto plot) here "
                        "(default with --sweep: flashlane-eval-<time>)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    add_engine_flags(p)
    return p


def run(args) -> int:
    apply_thread_default(args)   # before torch loads
    from ..evaluate.corpus import default_corpus, read_corpus
    from ..evaluate.evaluator import EvalSettings, evaluate, reference_options
    from ..evaluate.report import markdown, write_reports
    from ..evaluate.sweep import MODEL_KEY, Configuration, check_options, label, parse_sweep

    if args.greedy_prompts < 0:
        raise ValueError(f"--greedy-prompts must be >= 0, got {args.greedy_prompts}")
    base = engine_kwargs(args)
    points = parse_sweep(args.sweep) if args.sweep else [{}]
    if args.candidate_model:
        points = [{MODEL_KEY: args.candidate_model, **p} for p in points]
    if args.sweep:
        configs = [Configuration(label(p), p) for p in points]
    else:   # named by what differs from the reference run
        ref = reference_options(base)
        given = {**{k: v for k, v in base.items() if v != ref[k]}, **points[0]}
        configs = [Configuration(label(given) if given else "as the reference", points[0])]
    for c in configs:   # every bad option or value before any model loads
        check_options(base, c.options)
    corpus = read_corpus(args.corpus) if args.corpus else default_corpus()

    settings = EvalSettings(window=args.window, max_windows=args.max_windows, greedy_prompts=args.greedy_prompts,
                            greedy_prompt_len=args.greedy_prompt_len, greedy_tokens=args.greedy_tokens,
                            decode_tokens=args.decode_tokens, measure_speed=not args.no_speed)
    with _Progress(len(configs) + 1, enabled=not args.no_progress) as progress:
        result = evaluate(args.model, base, configs, corpus, settings, on_done=progress.advance)
    out_dir = args.output_dir or (f"flashlane-eval-{time.strftime('%Y%m%d-%H%M%S')}" if args.sweep else None)
    if out_dir:
        for path in write_reports(result, out_dir):
            print(f"wrote {path}", file=sys.stderr)
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print(markdown(result), end="")
    return 0


class _Progress:
    """A rich bar over configurations (the reference first), on stderr."""

    def __init__(self, total: int, enabled: bool):
        self.bar = None
        if enabled:
            from rich.console import Console
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

            self.bar = Progress(TextColumn("[bold]eval"), BarColumn(), MofNCompleteColumn(),
                                TextColumn("{task.fields[info]}"), TimeElapsedColumn(),
                                console=Console(file=sys.stderr))
            self.task = self.bar.add_task("eval", total=total, info="reference")

    def __enter__(self):
        if self.bar:
            self.bar.start()
        return self

    def __exit__(self, *exc):
        if self.bar:
            self.bar.stop()

    def advance(self, done_label: str) -> None:
        if self.bar:
            self.bar.update(self.task, advance=1, info=f"done: {done_label}")
