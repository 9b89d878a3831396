"""`flashlane tune`: Bayesian optimisation of serving knobs to an SLO.

Each trial starts a server with the knobs Optuna suggests (`--model M`: `flashlane serve`;
`--serve-command`: any OpenAI-compatible server from a template), replays the same seeded workload
against it, and stops it. The study is stored in SQLite and resumes when the same command runs
again; `--trials N` is the study's total. At the end the best trials are re-measured interleaved
with the default configuration.

  flashlane tune --model tiny-flash --trials 20 --slo p90_task_latency<=20s --slo ttft_p90<=2s
  flashlane tune --serve-command 'vllm serve M --port {port} --max-num-seqs {max_num_seqs} ...' \\
      --search-space space.json --tokenizer M
"""

from __future__ import annotations

import argparse
import hashlib
import re
import signal
import sys

from .bench_args import add_common, common_kwargs, positive_int, slo_dict
from .compare import SESSIONS_PER_LOAD
from .help import HelpFormatter
from .record import record_results


def add_parser(subparsers):
    # `resolve`: tune re-uses the bench's common options, but its --slo constrains the study
    # (p90_task_latency<=20s); the bench's per-request goodput SLO moves to --goodput-slo.
    p = subparsers.add_parser("tune", help="tune serving knobs to an SLO (Bayesian optimisation)",
                              description=__doc__, formatter_class=HelpFormatter, conflict_handler="resolve")
    t = p.add_mutually_exclusive_group(required=True)
    t.add_argument("--model", default=None, help="start `flashlane serve --model M` with each trial's knobs")
    t.add_argument("--serve-command", default=None,
                   help="server command template with {port}, {host}, {python} and one {knob} per knob "
                        "of the search space (vLLM, SGLang, ...: see the README)")
    p.add_argument("--serve-arg", action="append", default=[],
                   help="--model: extra `flashlane serve` argument for every trial (repeatable)")
    p.add_argument("--search-space", default=None,
                   help="JSON (or YAML with PyYAML) file of knobs (default: the built-in flashlane space; "
                        "required with --serve-command)")
    p.add_argument("--workload", choices=("agentic", "multiturn", "fixed"), default="agentic",
                   help="bench workload replayed in every trial (the same seeded sessions each time)")
    p.add_argument("--trace", default=None, help="agentic: replay this trace file (default: synthetic sessions)")
    p.add_argument("--scale", choices=tuple(SESSIONS_PER_LOAD), default="medium",
                   help="agentic: size of the synthetic sessions and sessions per trial, as in compare")
    p.add_argument("--input-len", type=positive_int, default=256, help="fixed workload: prompt tokens")
    p.add_argument("--output-len", type=positive_int, default=64, help="fixed workload: output tokens")
    load = p.add_mutually_exclusive_group()
    load.add_argument("--concurrency", type=positive_int, default=None,
                      help="closed-loop lanes (agentic: sessions at once) (default: 4)")
    load.add_argument("--request-rate", type=float, default=None, help="open-loop arrivals per second")
    p.add_argument("--objective", default="tasks_per_hour",
                   help="metric to maximise: tasks_per_hour, goodput (needs --goodput-slo) or output_tok_s")
    p.add_argument("--pareto", default=None,
                   help="multi-objective instead, e.g. tasks_per_hour,p90_task_latency (a Pareto front)")
    p.add_argument("--goodput-slo", type=slo_dict, default={}, dest="slo",
                   help="per-request SLOs for the goodput metric, e.g. ttft=2,tpot=0.1,e2e=30")
    p.add_argument("--trials", type=positive_int, default=20,
                   help="trials in the study in total (a rerun with a larger N continues it)")
    p.add_argument("--sampler", choices=("tpe", "gp", "random", "grid"), default="tpe",
                   help="tpe: multivariate TPE, handles conditional knobs; gp: Gaussian process; grid: "
                        "every combination of categorical knobs, in random order (vLLM auto_tune style)")
    p.add_argument("--sampler-seed", type=int, default=0, help="seed of the sampler")
    p.add_argument("--storage", default=None,
                   help="Optuna storage URL (default: sqlite:///$FLASHLANE_HOME/tune/studies.db)")
    p.add_argument("--study-name", default=None,
                   help="default: from the target, workload, load and objective (so a rerun resumes)")
    p.add_argument("--output-dir", default=None,
                   help="trial folders, tune.json and report.html (default: $FLASHLANE_HOME/tune/<study>)")
    p.add_argument("--remeasure-top", type=int, default=2,
                   help="re-measure the best K trials against the default configuration at the end (0: off)")
    p.add_argument("--remeasure-repeats", type=positive_int, default=1,
                   help="rounds of that re-measurement (each round: the default, then the best K trials)")
    p.add_argument("--no-default-trial", action="store_true",
                   help="do not start a new study with the default configuration as trial 0")
    p.add_argument("--startup-timeout", type=float, default=600.0,
                   help="seconds a trial's server may take to answer /health")
    add_common(p)  # --duration is the per-trial time budget, --num-sessions the sessions per trial
    p.add_argument("--slo", action="append", default=[], dest="constraints",
                   help="constraint, repeatable: p90_task_latency<=20s, ttft_p90<=2s, error_rate<=0.01 ...")
    p.set_defaults(func=run)
    return p


def serve_flags() -> dict[str, tuple | None]:
    """The flags `flashlane serve` has now, with their choices (None: any value)."""
    from . import serve
    sub = argparse.ArgumentParser().add_subparsers()
    parser = serve.add_parser(sub)
    return {opt: (tuple(a.choices) if a.choices else None) for a in parser._actions for opt in a.option_strings}


def study_name(args, objective) -> str:
    target = args.model or "cmd-" + hashlib.sha256(args.serve_command.encode()).hexdigest()[:8]
    load = f"c{args.concurrency}" if args.concurrency else f"r{args.request_rate:g}"
    work = args.workload + (f"-{args.scale}" if args.workload == "agentic" and not args.trace else "")
    return re.sub(r"[^A-Za-z0-9._-]+", "_", f"{target}-{work}-{load}-{'-'.join(objective.metrics)}")


def run(args) -> int:
    from flashlane.results.store import flashlane_home

    try:
        return _run(args, flashlane_home())
    except ValueError as e:
        print(f"flashlane tune: error: {e}", file=sys.stderr)
        return 2


def _run(args, home) -> int:
    from pathlib import Path

    from flashlane.tune.report import build_result, render_text, write_report
    from flashlane.tune.study import StudySettings, fingerprint, open_study

    # Everything is checked before any server starts.
    objective = _objective(args)
    space, target = _target(args)
    bench = _bench(args)
    name = args.study_name or study_name(args, objective)
    (home / "tune").mkdir(parents=True, exist_ok=True)
    storage = args.storage or f"sqlite:///{home / 'tune' / 'studies.db'}"
    out = Path(args.output_dir) if args.output_dir else home / "tune" / name
    settings = StudySettings(storage=storage, study_name=name, n_trials=args.trials, out_dir=out,
                             sampler=args.sampler, seed=args.sampler_seed, remeasure_top=args.remeasure_top,
                             remeasure_repeats=args.remeasure_repeats, default_first=not args.no_default_trial,
                             progress=not args.no_progress)
    stored = fingerprint(target, space, objective, bench)
    study = open_study(settings, objective, space, stored)
    log = (lambda m: None) if args.no_progress else (lambda m: print(m, file=sys.stderr))
    log(f"study {name} in {storage}: {len(study.trials)} trial(s) so far, target {args.trials}")
    remeasured, interrupted = _search(study, settings, target, space, objective, bench, log)
    result = build_result(study, objective, target, remeasured, stored, space.defaults())
    result["interrupted"] = interrupted
    report = write_report(out, result, study, objective)
    if interrupted:
        print(f"tune: interrupted; servers stopped; the study resumes with the same command "
              f"(--study-name {name})", file=sys.stderr)
        return 130
    print(render_text(result))
    print(f"report: {report}")
    record_results(args, "tune", out, targets=_recorded_points(result))
    return 0


def _objective(args):
    """The study's objective from the load and objective options (which it checks; it also
    defaults the load to 4 lanes)."""
    from flashlane.tune.objective import Objective, parse_slo

    if args.concurrency is None and args.request_rate is None:
        args.concurrency = 4
    if args.request_rate is not None and not args.request_rate > 0:
        raise ValueError(f"--request-rate: must be > 0, got {args.request_rate}")
    if args.remeasure_top < 0:
        raise ValueError(f"--remeasure-top: must be >= 0, got {args.remeasure_top}")
    metrics = tuple(m.strip() for m in args.pareto.split(",") if m.strip()) if args.pareto else (args.objective,)
    if args.pareto and len(metrics) < 2:
        raise ValueError(f"--pareto: needs two or more metrics, got {args.pareto!r}")
    objective = Objective(metrics, tuple(parse_slo(s) for s in args.constraints))
    if "goodput" in objective.metrics and not args.slo:
        raise ValueError("--objective goodput: give the per-request SLOs with --goodput-slo ttft=S,tpot=S,e2e=S")
    return objective


def _target(args):
    """The search space and the server each trial starts with a point of it."""
    from flashlane.tune.space import flashlane_space, load_space
    from flashlane.tune.target import FlashlaneTarget, TemplateTarget

    if args.serve_command:
        if not args.search_space:
            raise ValueError("--serve-command: give the knobs with --search-space (the built-in space is "
                             "flashlane's)")
        space = load_space(args.search_space)
        return space, TemplateTarget(args.serve_command, space)
    space = (load_space(args.search_space) if args.search_space
             else flashlane_space(offered=serve_flags(), mtp=has_mtp_layers(args.model)))
    return space, FlashlaneTarget(args.model, space, list(args.serve_arg))


def has_mtp_layers(model: str) -> bool:
    """Whether MODEL's config lists MTP layers (then the built-in space drafts with them too); a
    model whose config cannot be read here searches n-gram drafts only."""
    from flashlane.analyze.models import resolve_model
    from flashlane.config import ConfigError

    try:
        cfg = resolve_model(model).cfg
    except (ConfigError, OSError):
        return False
    return cfg.arch != "llama" and cfg.num_mtp_layers > 0


def _bench(args):
    """The workload every trial replays, at the one load point of the study."""
    from flashlane.bench.load import LoadPoint
    from flashlane.bench.runner import BenchConfig, build_source
    from flashlane.bench.text_synth import TextSynth, load_tokenizer
    from flashlane.bench.workloads.fixed import FixedSpec
    from flashlane.tune.trial import Bench

    from .. import presets

    kw = common_kwargs(args)
    kw["progress"] = False
    point = LoadPoint(concurrency=args.concurrency) if args.concurrency else LoadPoint(request_rate=args.request_rate)
    cfg = BenchConfig(base_url="http://unset", output_dir="unset", workload=args.workload, trace=args.trace,
                      scale=args.scale, concurrency=[args.concurrency] if args.concurrency else None,
                      request_rates=[args.request_rate] if args.request_rate else None,
                      sessions_per_load=SESSIONS_PER_LOAD[args.scale],
                      fixed=FixedSpec(args.input_len, args.output_len), **kw)
    cfg.control(point)  # bad --num-sessions / --duration before a server starts

    def make_synth():
        spec = args.tokenizer or args.model
        try:
            tok = load_tokenizer(spec, presets.tokenizer_file)
        except ValueError:
            if args.tokenizer:
                raise
            tok = None  # a model id without a local tokenizer: the one-word-per-token approximation
        return TextSynth(seed=args.seed, tokenizer=tok)

    return Bench(cfg=cfg, source=build_source(cfg), point=point, make_synth=make_synth,
                 startup_timeout_s=args.startup_timeout)


def _search(study, settings, target, space, objective, bench, log):
    """Runs the trials, then (single objective) the re-measurement; Ctrl-C or SIGTERM stops it
    early. Returns (the re-measurement or None, whether it was interrupted)."""
    from flashlane.tune.study import remeasure, run_trials

    previous = signal.getsignal(signal.SIGTERM)

    def on_term(*_):
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_term)
    remeasured = None
    try:
        run_trials(study, settings, target, space, objective, bench, log)
        if not objective.pareto:
            remeasured = remeasure(study, settings, target, space, objective, bench, log)
    except KeyboardInterrupt:
        return remeasured, True
    finally:
        signal.signal(signal.SIGTERM, previous)
    return remeasured, False


def _recorded_points(result: dict):
    """The re-measured configurations, named as in the report ("default", "trial-N"; round k > 1
    as "trial-N-rk"), else the best trial's own measurement ("trial-N"). Never "best": the search's
    ranking is on one noisy measurement, and the re-measurement may put a trial below the default."""
    from pathlib import Path
    rm = result.get("remeasure")
    if rm:
        pts = [(name if k == 0 else f"{name}-r{k + 1}", Path(r["run_dir"]))
               for name, c in rm["configs"].items() for k, r in enumerate(c["runs"])]
        if pts:
            return pts
    if result.get("best"):
        t = next(r for r in result["trials"] if r["number"] == result["best"]["trial"])
        return [(f"trial-{t['number']}", Path(t["run_dir"]))]
    return []
