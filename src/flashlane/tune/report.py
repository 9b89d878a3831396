"""The study's results: best configuration as a command line, a table of trials, parameter
importances (fANOVA), optimisation-history and trade-off / Pareto plots, the re-measurement
against the default; written as tune.json and a self-contained report.html."""

from __future__ import annotations

import importlib.util
import io
import json
import shlex
import warnings
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.ticker import MaxNLocator  # noqa: E402
import optuna  # noqa: E402
from optuna.trial import TrialState  # noqa: E402

from flashlane.bench import report_html  # noqa: E402
from flashlane.results.metrics import METRICS  # noqa: E402

from .objective import Objective  # noqa: E402
from .study import feasible, finished, ranked  # noqa: E402

MIN_TRIALS_FOR_IMPORTANCE = 4
COMMAND_WIDTH = 88   # a pasted serve command wraps here, with shell line continuations


def importances(study: optuna.Study, objective: Objective) -> tuple[dict[str, float], str | None]:
    """fANOVA importances of the knobs for the first objective, or ({}, why not)."""
    done = [t for t in study.get_trials(deepcopy=False) if t.state == TrialState.COMPLETE]
    if len(done) < MIN_TRIALS_FOR_IMPORTANCE:
        return {}, (f"parameter importances need at least {MIN_TRIALS_FOR_IMPORTANCE} completed trials "
                    f"(this study has {len(done)})")
    if importlib.util.find_spec("sklearn") is not None:  # fANOVA fits scikit-learn's random forest
        evaluator, note = optuna.importance.FanovaImportanceEvaluator(seed=0), None
    else:
        evaluator = optuna.importance.PedAnovaImportanceEvaluator()
        note = "importances by PED-ANOVA (fANOVA needs scikit-learn, which is not installed)"
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            imp = optuna.importance.get_param_importances(study, evaluator=evaluator,
                                                          target=lambda t: t.values[0])
    except (RuntimeError, ValueError) as e:
        return {}, f"parameter importances unavailable: {e}"
    if not imp:
        return {}, "parameter importances unavailable: no knob varied across the completed trials"
    return {k: float(v) for k, v in imp.items()}, note


def trial_rows(study: optuna.Study, objective: Objective) -> list[dict]:
    rows = []
    for t in study.get_trials(deepcopy=False):
        if t.state not in (TrialState.COMPLETE, TrialState.FAIL):
            continue
        ms = t.user_attrs.get("metrics", {})
        rows.append({"number": t.number, "state": t.state.name.lower(),
                     "interrupted": bool(t.user_attrs.get("interrupted")),
                     "default": bool(t.user_attrs.get("default")), "params": dict(t.params),
                     "values": list(t.values) if t.values else None,
                     "ci": {n: ms[n][1:] for n in objective.metrics if n in ms},
                     "constraints": dict(t.constraints), "feasible": feasible(t),
                     "metrics": ms, "command": t.user_attrs.get("command"),
                     "failure": t.user_attrs.get("failure"), "log_tail": t.user_attrs.get("log_tail"),
                     "run_dir": t.user_attrs.get("run_dir")})
    return rows


def _png(fig) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=90, bbox_inches="tight")
    plt.close(fig)
    return buf.getvalue()


def history_plot(rows: list[dict], objective: Objective) -> bytes:
    name = objective.metrics[0]
    maximize = objective.directions[0] == "maximize"
    fig, ax = plt.subplots(figsize=(8, 3.6))
    done = [r for r in rows if r["values"]]
    for ok, colour, label in ((True, "#2171b5", "meets the SLOs"), (False, "#bbbbbb", "misses an SLO")):
        pts = [r for r in done if r["feasible"] == ok]
        if pts:
            ax.scatter([r["number"] for r in pts], [r["values"][0] for r in pts], c=colour, label=label,
                       zorder=3)
    best, xs, ys = None, [], []
    for r in sorted(done, key=lambda r: r["number"]):
        if r["feasible"] and (best is None or (r["values"][0] > best if maximize else r["values"][0] < best)):
            best = r["values"][0]
        if best is not None:
            xs.append(r["number"])
            ys.append(best)
    if xs:
        ax.step(xs, ys, where="post", color="#cb181d", label="best feasible so far")
    failed = [r["number"] for r in rows if r["state"] == "fail" and not r["interrupted"]]
    for i, n in enumerate(failed):
        ax.axvline(n, color="#fc9272", ls=":", lw=1, label="failed trial" if i == 0 else None)
    ax.set_xlabel("trial")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_ylabel(f"{name} ({METRICS[name].unit})")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    ax.set_title("Optimisation history")
    return _png(fig)


def tradeoff_plot(rows: list[dict], objective: Objective, study: optuna.Study) -> bytes | None:
    """The two objectives of a Pareto study (front highlighted), or the objective against the
    first SLO's metric."""
    if objective.pareto:
        x_name, y_name = objective.metrics[1], objective.metrics[0]
        front = {t.number for t in study.best_trials}
    elif objective.slos:
        x_name, y_name, front = objective.slos[0].metric, objective.metrics[0], set()
    else:
        return None
    pts = [r for r in rows if r["values"] and x_name in r["metrics"] and y_name in r["metrics"]]
    if not pts:
        return None
    fig, ax = plt.subplots(figsize=(6.5, 4))
    for r in pts:
        colour = "#cb181d" if r["number"] in front else ("#2171b5" if r["feasible"] else "#bbbbbb")
        ax.scatter(r["metrics"][x_name][0], r["metrics"][y_name][0], c=colour, zorder=3)
        ax.annotate(str(r["number"]), (r["metrics"][x_name][0], r["metrics"][y_name][0]), fontsize=7)
    for slo in objective.slos:
        if slo.metric == x_name:
            ax.axvline(slo.bound, color="#555", ls="--", lw=1, label=f"SLO {slo.text}")
    ax.set_xlabel(f"{x_name} ({METRICS[x_name].unit})")
    ax.set_ylabel(f"{y_name} ({METRICS[y_name].unit})")
    ax.grid(alpha=0.3)
    ax.set_title("Pareto front (red)" if objective.pareto else "Trade-off (blue: meets the SLOs)")
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=8)
    return _png(fig)


def build_result(study: optuna.Study, objective: Objective, target, remeasured: dict | None,
                 settings: dict, default_params: dict | None = None) -> dict:
    rows = trial_rows(study, objective)
    best = ranked(study, objective)
    imp, imp_note = importances(study, objective)
    out = {"study": study.study_name, "objective": objective.describe(), "metrics": list(objective.metrics),
           "directions": objective.directions, "slos": [s.text for s in objective.slos], "settings": settings,
           "n_trials": len(finished(study)), "n_failed": sum(1 for r in rows if r["state"] == "fail"
                                                              and not r["interrupted"]),
           "best": None, "pareto_front": [], "importances": imp, "importances_note": imp_note,
           "remeasure": remeasured, "default_params": default_params, "trials": rows}
    if best:
        b = best[0]
        out["best"] = {"trial": b.number, "params": dict(b.params), "values": list(b.values),
                       "metrics": b.user_attrs.get("metrics"), "command": target.paste(dict(b.params))}
    if objective.pareto:
        out["pareto_front"] = [{"trial": t.number, "values": list(t.values), "command": t.user_attrs.get("command")}
                               for t in sorted(study.best_trials, key=lambda t: t.number)]
    return out


def improvement_text(result: dict) -> list[str]:
    rm = result.get("remeasure")
    if not rm:
        return []
    lines, name = [], rm["metric"]
    for cname, c in rm["configs"].items():
        vals = [r["metrics"][name][0] for r in c["runs"] if name in r["metrics"]]
        if not vals:
            lines.append(f"{cname}: not re-measured ({'; '.join(c['failures']) or 'no value'})")
            continue
        text = f"{cname}: {name} {sum(vals) / len(vals):.4g} over {len(vals)} run(s)"
        for other in dict.fromkeys(slo.split("<")[0].split(">")[0] for slo in result["slos"]):
            seen = [r["metrics"][other] for r in c["runs"] if other in r["metrics"]]
            if seen and other != name:
                v, lo, hi = seen[0]
                text += f", {other} {v:.4g}" + (f" [{lo:.4g}, {hi:.4g}]" if lo is not None else "")
        if c["runs"] and not all(r["slo_met"] for r in c["runs"]):
            text += " (misses an SLO)"
        r = c.get("ratio_to_default")
        if cname != "default" and r:
            ci = (f", 95% CI {r['low']:.2f}–{r['high']:.2f}" if r["low"] is not None else ", no CI")
            text += f"; {r['ratio']:.2f}× the default{ci}"
        lines.append(text)
    return lines


def command_block(command: str, indent: str = "", width: int = COMMAND_WIDTH) -> str:
    """`command` as shell lines of at most `width` characters (one flag never split from its
    value), joined by backslash continuations: pasted into a shell it runs unchanged. Words keep
    their quotes and `$VARS` as written (non-POSIX splitting), so nothing is re-quoted."""
    groups: list[list[str]] = [[]]   # the program and its positionals, then one group per flag
    for word in shlex.split(command, posix=False):
        if word.startswith("-") and not word[1:2].isdigit() and groups[-1]:
            groups.append([])
        groups[-1].append(word)
    lines = [indent + " ".join(groups[0])]
    for g in groups[1:]:
        piece = " ".join(g)
        if len(lines[-1]) + 1 + len(piece) + 2 <= width:
            lines[-1] += " " + piece
        else:
            lines.append(indent + "  " + piece)
    return " \\\n".join(lines)


def render_text(result: dict) -> str:
    lines = [f"study {result['study']}: {result['objective']}",
             f"{result['n_trials']} trial(s), {result['n_failed']} failed"]
    b = result["best"]
    if b:
        ms = b["metrics"] or {}
        shown = ", ".join(f"{n} {ms[n][0]:.4g}" + (f" [{ms[n][1]:.4g}, {ms[n][2]:.4g}]" if ms[n][1] is not None else "")
                          for n in dict.fromkeys(result["metrics"] + [s.split("<")[0].split(">")[0]
                                                                      for s in result["slos"]]) if n in ms)
        is_default = b["params"] == (result.get("default_params") or {})
        lines += [f"best feasible: trial {b['trial']}{' (the default configuration)' if is_default else ''}: "
                  f"{shown}", "  serve it with:", command_block(b["command"], indent="    ")]
    else:
        lines.append("no trial met the SLOs")
    for f in result["pareto_front"]:
        lines.append(f"pareto front: trial {f['trial']}: "
                     + ", ".join(f"{n} {v:.4g}" for n, v in zip(result["metrics"], f["values"])))
    lines += improvement_text(result)
    if result["importances"]:
        lines.append("importances: " + ", ".join(f"{k} {v:.2f}" for k, v in result["importances"].items()))
    if result["importances_note"]:
        lines.append(result["importances_note"])
    return "\n".join(lines)


def write_report(out_dir: Path, result: dict, study: optuna.Study, objective: Objective) -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "tune.json").write_text(json.dumps(result, indent=2, default=str))
    rows = result["trials"]
    head = ["trial", "state"] + list(objective.metrics) + ["SLOs met", "configuration / failure"]
    table = []
    for r in rows:
        vals = [(f"{r['values'][i]:.4g}" + (f" [{r['ci'][n][0]:.4g}, {r['ci'][n][1]:.4g}]"
                                            if n in r["ci"] and r["ci"][n][0] is not None else ""))
                if r["values"] else "–" for i, n in enumerate(objective.metrics)]
        state = "interrupted" if r["interrupted"] else r["state"] + (" (default)" if r["default"] else "")
        table.append([r["number"], state] + vals + ["yes" if r["feasible"] else "no",
                                                     r["failure"] or r["command"] or ""])
    sections = [("Result", "<pre>" + report_html.html.escape(render_text(result)) + "</pre>"),
                ("Trials", report_html.table(head, table))]
    note = (f"<p class='note'>{report_html.html.escape(result['importances_note'])}</p>"
            if result["importances_note"] else "")
    if result["importances"] or note:
        sections.append(("Parameter importances", (report_html.table(
            ["knob", "importance"], [[k, f"{v:.3f}"] for k, v in result["importances"].items()])
            if result["importances"] else "") + note))
    sections.append(("Optimisation history", report_html.img(history_plot(rows, objective), "history")))
    trade = tradeoff_plot(rows, objective, study)
    if trade is not None:
        sections.append(("Pareto front" if objective.pareto else "Trade-off", report_html.img(trade, "trade-off")))
    failed = [r for r in rows if r["failure"]]
    if failed:
        sections.append(("Failed trials", "".join(
            f"<h3>trial {r['number']}: {report_html.html.escape(r['failure'])}</h3>"
            f"<pre>{report_html.html.escape(r['log_tail'] or '')}</pre>" for r in failed)))
    path = out_dir / "report.html"
    path.write_text(report_html.page(f"flashlane tune — {result['study']}", sections))
    return path
