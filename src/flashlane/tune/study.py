"""The study loop: ask Optuna for a configuration, measure it, tell the result (or the failure),
until the study holds `n_trials` finished trials; then re-measure the best few interleaved with
the default configuration. The study lives in Optuna's RDB storage (SQLite), so an interrupted or
finished study resumes when the same command runs again (a larger `n_trials` continues it)."""

from __future__ import annotations

import json
import math
import sys
from dataclasses import dataclass
from pathlib import Path

import optuna
from optuna.trial import TrialState

from .objective import Objective
from .samplers import make_sampler
from .space import SearchSpace
from .trial import Bench, Measurement, TrialFailed, measure

Z95 = 1.959964


@dataclass
class StudySettings:
    storage: str
    study_name: str
    n_trials: int
    out_dir: Path
    sampler: str = "tpe"
    seed: int = 0
    remeasure_top: int = 2
    remeasure_repeats: int = 1
    default_first: bool = True  # trial 0 measures the server's defaults (the baseline)
    progress: bool = True


def finished(study: optuna.Study) -> list[optuna.trial.FrozenTrial]:
    """Trials that count towards --trials: complete or failed, not interrupted by the user."""
    return [t for t in study.get_trials(deepcopy=False)
            if t.state in (TrialState.COMPLETE, TrialState.FAIL) and not t.user_attrs.get("interrupted")]


def feasible(t: optuna.trial.FrozenTrial) -> bool:
    return t.state == TrialState.COMPLETE and all(v <= 0 for v in t.constraints.values())


def ranked(study: optuna.Study, objective: Objective) -> list[optuna.trial.FrozenTrial]:
    """Feasible complete trials, best first by the (first) objective."""
    sign = -1.0 if objective.directions[0] == "maximize" else 1.0
    return sorted((t for t in study.get_trials(deepcopy=False) if feasible(t)),
                  key=lambda t: (sign * t.values[0], t.number))


def fingerprint(target, space: SearchSpace, objective: Objective, bench: Bench) -> dict:
    return {"target": target.describe(), "space": space.to_json(), "objective": objective.fingerprint(),
            "workload": bench.source.spec, "load_point": bench.point.label,
            "duration_s": bench.cfg.duration_s, "num_sessions": bench.cfg.num_sessions}


def open_study(s: StudySettings, objective: Objective, space: SearchSpace, settings: dict) -> optuna.Study:
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    try:
        storage = optuna.storages.RDBStorage(s.storage)
    except Exception as e:  # SQLAlchemy: unknown dialect, unreachable file, not a database ...
        raise ValueError(f"--storage {s.storage}: {type(e).__name__}: {e}") from None
    try:
        existing = optuna.load_study(study_name=s.study_name, storage=storage)
    except KeyError:
        existing = None
    n_before = len(existing.trials) if existing else 0
    sampler = make_sampler(s.sampler, space, s.seed + n_before, s.n_trials)  # fresh draws on resume
    if existing is not None:
        stored = existing.user_attrs.get("settings")
        if stored is not None and json.loads(json.dumps(settings, default=str)) != stored:
            diff = sorted(k for k in set(stored) | set(settings)
                          if json.dumps(stored.get(k), default=str) != json.dumps(settings.get(k), default=str))
            raise ValueError(f"--study-name {s.study_name}: the stored study was made with other settings "
                             f"({', '.join(diff)} differ); use another --study-name or the same settings")
        if existing.directions != [optuna.study.StudyDirection.MAXIMIZE if d == "maximize" else
                                   optuna.study.StudyDirection.MINIMIZE for d in objective.directions]:
            raise ValueError(f"--study-name {s.study_name}: the stored study has other objective directions")
        return optuna.load_study(study_name=s.study_name, storage=storage, sampler=sampler)
    study = optuna.create_study(study_name=s.study_name, storage=storage, sampler=sampler,
                                directions=objective.directions)
    study.set_user_attr("settings", json.loads(json.dumps(settings, default=str)))
    return study


def record_measurement(trial, m: Measurement, objective: Objective, target, params: dict) -> list[float]:
    for slo in objective.slos:
        value = m.metrics.get(slo.metric, (None,))[0]
        trial.set_constraint(slo.text, slo.violation(value))
    trial.set_user_attr("metrics", {k: list(v) for k, v in m.metrics.items()})
    trial.set_user_attr("command", target.paste(params))
    trial.set_user_attr("run_dir", str(m.run_dir))
    trial.set_user_attr("valid", m.summary["validity"]["valid"])
    return [m.metrics[n][0] for n in objective.metrics]


class TrialProgress:
    """A rich progress bar over the study's trials with the best feasible result so far."""

    def __init__(self, total: int, done: int, enabled: bool):
        self.enabled = enabled
        if not enabled:
            return
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
        self.progress = Progress(TextColumn("[bold]tune"), BarColumn(), MofNCompleteColumn(),
                                 TextColumn("{task.fields[best]}"), TextColumn("{task.fields[now]}"),
                                 TimeElapsedColumn(), console=Console(file=sys.stderr))
        self.task = self.progress.add_task("tune", total=total, completed=done, best="", now="")

    def __enter__(self):
        if self.enabled:
            self.progress.start()
        return self

    def __exit__(self, *exc):
        if self.enabled:
            self.progress.stop()

    def update(self, advance: int = 0, best: str | None = None, now: str | None = None):
        if not self.enabled:
            return
        fields = {k: v for k, v in (("best", best), ("now", now)) if v is not None}
        self.progress.update(self.task, advance=advance, **fields)


def best_text(study, objective: Objective) -> str:
    r = ranked(study, objective)
    if not r:
        return "best: none feasible yet"
    return f"best {r[0].values[0]:.4g} {objective.metrics[0]} (trial {r[0].number})"


def run_trials(study: optuna.Study, s: StudySettings, target, space: SearchSpace, objective: Objective,
               bench: Bench, log=lambda m: None) -> int:
    """Run trials until the study holds `s.n_trials` finished ones; returns how many ran now."""
    if s.default_first and not study.trials:
        study.enqueue_trial(space.defaults(), user_attrs={"default": True})
    ran = 0
    done = len(finished(study))
    with TrialProgress(s.n_trials, min(done, s.n_trials), s.progress) as bar:
        bar.update(best=best_text(study, objective))
        while len(finished(study)) < s.n_trials:
            trial = study.ask()
            params = space.suggest(trial)
            run_dir = s.out_dir / "trials" / f"trial-{trial.number:04d}"
            bar.update(now=f"trial {trial.number}")
            try:
                m = measure(target, params, bench, run_dir,
                            on_status=lambda st, n=trial.number: bar.update(now=f"trial {n}: {st}"))
                values = record_measurement(trial, m, objective, target, params)
                study.tell(trial, values)
                log(f"trial {trial.number}: {', '.join(f'{n}={v:.4g}' for n, v in zip(objective.metrics, values))}"
                    f"{'' if feasible(study.trials[trial.number]) else ' (misses an SLO)'}  {target.paste(params)}")
            except TrialFailed as f:
                trial.set_user_attr("failure", f.reason)
                trial.set_user_attr("log_tail", f.log_tail[-4000:])
                trial.set_user_attr("command", target.paste(params))
                trial.set_user_attr("run_dir", str(run_dir))
                study.tell(trial, state=TrialState.FAIL)
                log(f"trial {trial.number}: FAILED: {f.reason}")
            except BaseException:  # Ctrl-C (or SIGTERM): the trial does not count; servers are stopped
                if study.trials[trial.number].state == TrialState.RUNNING:
                    trial.set_user_attr("interrupted", True)
                    study.tell(trial, state=TrialState.FAIL)
                raise
            ran += 1
            bar.update(advance=1, best=best_text(study, objective), now="")
    return ran


def log_ci(v: float, lo: float | None, hi: float | None) -> float | None:
    """Standard error of ln(value) from a 95% CI (None without one)."""
    if lo is None or hi is None or lo <= 0 or hi <= 0 or v <= 0:
        return None
    return (math.log(hi) - math.log(lo)) / (2 * Z95)


def ratio_ci(a: list[tuple], b: list[tuple]) -> dict | None:
    """Ratio of geometric means A / B over repeated measurements (value, lo, hi), with a 95% CI
    from the measurements' own CIs on the log scale (delta method); None if a value is not > 0."""
    if not a or not b or any(x[0] is None or x[0] <= 0 for x in a + b):
        return None
    la = sum(math.log(x[0]) for x in a) / len(a)
    lb = sum(math.log(x[0]) for x in b) / len(b)
    out = {"ratio": math.exp(la - lb), "low": None, "high": None}
    sa, sb = [log_ci(*x) for x in a], [log_ci(*x) for x in b]
    if None not in sa + sb:
        se = math.sqrt(sum(s * s for s in sa) / len(a) ** 2 + sum(s * s for s in sb) / len(b) ** 2)
        out["low"], out["high"] = math.exp(la - lb - Z95 * se), math.exp(la - lb + Z95 * se)
    return out


def remeasure(study: optuna.Study, s: StudySettings, target, space: SearchSpace, objective: Objective,
              bench: Bench, log=lambda m: None) -> dict | None:
    """Measure the best `remeasure_top` trials and the default configuration again, interleaved
    (default, best 1, best 2, default, ...), so the machine's drift hits all alike."""
    defaults = space.defaults()
    top = [t for t in ranked(study, objective)[: s.remeasure_top] if dict(t.params) != defaults]
    if not top or s.remeasure_repeats < 1:
        return None  # nothing feasible, or the best is the default configuration itself
    configs = [("default", defaults)] + [(f"trial-{t.number}", dict(t.params)) for t in top]
    key = [name for name, _ in configs] + [s.remeasure_repeats]
    cached = study.user_attrs.get("remeasure")
    if cached and cached.get("key") == key:
        return cached
    runs: dict[str, list] = {name: [] for name, _ in configs}
    failures: dict[str, list[str]] = {name: [] for name, _ in configs}
    name0 = objective.metrics[0]
    for rep in range(s.remeasure_repeats):
        for name, params in configs:
            run_dir = s.out_dir / "remeasure" / f"r{rep + 1}-{name}"
            log(f"re-measuring {name} (round {rep + 1}/{s.remeasure_repeats})")
            try:
                m = measure(target, params, bench, run_dir)
            except TrialFailed as f:
                failures[name].append(f.reason)
                continue
            runs[name].append({"run_dir": str(run_dir), "metrics": {k: list(v) for k, v in m.metrics.items()},
                               "slo_met": all(slo.met(m.metrics.get(slo.metric, (None,))[0])
                                              for slo in objective.slos)})
    out = {"key": key, "metric": name0, "configs": {}}
    for name, params in configs:
        vals = [tuple(r["metrics"][name0]) for r in runs[name] if name0 in r["metrics"]]
        out["configs"][name] = {"params": params, "command": target.paste(params), "runs": runs[name],
                                "failures": failures[name],
                                "ratio_to_default": ratio_ci(vals, [tuple(r["metrics"][name0])
                                                                    for r in runs["default"]
                                                                    if name0 in r["metrics"]])}
    study.set_user_attr("remeasure", out)
    return out
