"""`flashlane history`: the runs in the results store (every bench, compare and tune run).

  flashlane history                                   # list runs
  flashlane history --model tiny-flash --metric tasks_per_hour   # a metric's trend
  flashlane history check --baseline 12 --candidate latest --metric p90_task_latency
                                                      # exit 1 if it regressed beyond its CI
"""

from __future__ import annotations

import sys
import textwrap

from .help import HelpFormatter

SPARK = "▁▂▃▄▅▆▇█"
POINTS_WIDTH = 60   # the points column wraps here, onto continuation rows, between point names


def _filters(p) -> None:
    p.add_argument("--results-db", default=None, help="results store (default: $FLASHLANE_HOME/results.db)")


def add_parser(subparsers):
    p = subparsers.add_parser("history", help="list recorded runs, show trends, check for regressions",
                              description=__doc__, formatter_class=HelpFormatter)
    _filters(p)
    p.add_argument("--model", default=None, help="only runs of this model")
    p.add_argument("--workload", default=None, help="only this workload, e.g. agentic/small")
    p.add_argument("--stack", default=None, help="only this serving stack (flashlane, vllm, ...) or target name")
    p.add_argument("--kind", choices=("bench", "compare", "tune", "simulate"), default=None,
                   help="only this kind of run (simulate: `flashlane simulate` runs, in simulated time)")
    p.add_argument("--metric", default=None, help="show this metric's trend (e.g. tasks_per_hour)")
    p.add_argument("--limit", type=int, default=None, help="newest N runs only")
    sub = p.add_subparsers(dest="action", metavar="ACTION")
    c = sub.add_parser("check", help="did a metric regress from a baseline run to a candidate run?",
                       formatter_class=HelpFormatter)
    _filters(c)
    c.add_argument("--baseline", required=True, help="run id, latest or latest~N")
    c.add_argument("--candidate", required=True, help="run id, latest or latest~N")
    c.add_argument("--metric", default="tasks_per_hour", help="metric to check")
    c.add_argument("--tolerance", type=float, default=0.05,
                   help="relative worsening that counts as a regression when a side has no CI")
    p.set_defaults(func=run)
    return p


def fmt(v) -> str:
    return "–" if v is None else f"{v:.4g}"


def with_ci(vals) -> str:
    v, lo, hi = vals
    return fmt(v) + (f" [{fmt(lo)}, {fmt(hi)}]" if lo is not None and hi is not None else "")


def run(args) -> int:
    from flashlane.results.store import ResultsStore, SchemaError, default_db_path

    db = args.results_db or default_db_path()
    try:
        store = ResultsStore(db)
    except SchemaError as e:
        print(f"flashlane history: error: {e}", file=sys.stderr)
        return 2
    with store:
        try:
            if args.action == "check":
                return check(store, args)
            if args.metric:
                return trend(store, args)
            return listing(store, args)
        except ValueError as e:
            print(f"flashlane history: error: {e}", file=sys.stderr)
            return 2


def listing(store, args) -> int:
    from flashlane.bench.report_md import md_table

    runs = store.runs(model=args.model, workload=args.workload, stack=args.stack, kind=args.kind, limit=args.limit)
    if not runs:
        print(f"no runs recorded in {store.path}" + (" match the filters" if any(
            (args.model, args.workload, args.stack, args.kind)) else ""))
        return 0
    rows = []
    for r in runs:
        pts = store.points(r.id)
        first = pts[0].metrics if pts else {}
        names = ", ".join(f"{p.target}/{p.label}" if p.target != r.model else p.label for p in pts)
        points = textwrap.wrap(names, POINTS_WIDTH, break_long_words=False, break_on_hyphens=False) or [""]
        rows.append([r.id, r.created_utc, r.kind, r.model or "–", r.workload or "–", stacks(r) or "–",
                     points[0], with_ci(first["tasks_per_hour"]) if "tasks_per_hour" in first else "–"])
        rows += [[""] * 6 + [more, ""] for more in points[1:]]
    print(md_table(["run", "created (UTC)", "kind", "model", "workload", "stack", "points",
                    "tasks/h (first point)"], rows))
    return 0


def stacks(run) -> str | None:
    """The serving stacks a compare ran (from its compare.json, in its order); else the stack that
    answered (its /v1/models owner) -- which for a compare is the same server under every stack."""
    listed = [s.get("name") for s in (run.summary.get("compare.json") or {}).get("stacks") or []]
    return ",".join(n for n in listed if n) or run.stack


def spark(values: list[float]) -> str:
    lo, hi = min(values), max(values)
    return "".join(SPARK[int((v - lo) / (hi - lo) * (len(SPARK) - 1)) if hi > lo else 0] for v in values)


def trend(store, args) -> int:
    from flashlane.bench.report_md import md_table
    from flashlane.results.metrics import metric

    m = metric(args.metric)
    series = store.trend(m.name, model=args.model, workload=args.workload, stack=args.stack, kind=args.kind)
    if args.limit:
        series = series[-args.limit:]
    if not series:
        print(f"no recorded run has {m.name}")
        return 0
    rows, by_key = [], {}
    for r, p in series:
        v = p.metrics[m.name]
        key = trend_key(r, p)
        prev = by_key.get(key, [None])[-1]
        change = f"{(v[0] - prev) / prev:+.1%}" if prev else "–"
        by_key.setdefault(key, []).append(v[0])
        rows.append([r.id, r.created_utc, r.kind, p.target, p.label, with_ci(v), change])
    print(md_table(["run", "created (UTC)", "kind", "target", "point", f"{m.name} ({m.unit or '-'})", "change"], rows))
    print(f"\n{m.name} ({'higher' if m.higher_is_better else 'lower'} is better), oldest to newest:")
    for key, vals in by_key.items():
        print(f"  {spark(vals)}  {' '.join(key)} ({len(vals)} run{'s' if len(vals) > 1 else ''})")
    return 0


def trend_key(run, point) -> tuple[str, ...]:
    """What one sparkline follows: the model, the target within the run (a stack, a tune
    configuration), simulated or measured, the workload and the load point; runs of other targets
    get their own line."""
    parts = [run.model or "?"]
    if point.target != run.model:
        parts.append(point.target)
    if run.kind == "simulate":      # a simulation's figures never continue a measured series
        parts.append("simulated")
    return (*parts, run.workload or "?", point.label)


def check(store, args) -> int:
    from flashlane.results.regression import check as check_runs

    verdicts = check_runs(store, args.baseline, args.candidate, args.metric, args.tolerance)
    b, c = store.resolve(args.baseline), store.resolve(args.candidate)
    bad = False
    for v in verdicts:
        status = "REGRESSION" if v.regressed else "ok"
        bad |= v.regressed
        print(f"{status}: {args.metric} at {v.key}: run {b} {with_ci(v.baseline)} -> run {c} "
              f"{with_ci(v.candidate)} ({v.change:+.1%} {'better' if v.change >= 0 else 'worse'}; "
              f"judged by {v.basis})")
    return 1 if bad else 0
