"""The Optuna samplers a study can use. Constraints (SLOs) reach TPE and GP through
`trial.set_constraint` (Optuna 5's replacement of `constraints_func`)."""

from __future__ import annotations

import warnings

import optuna

from .space import SearchSpace

SAMPLERS = ("tpe", "gp", "random", "grid")
# TPE handles the conditional knobs natively (multivariate, grouped by which knobs are active);
# GPSampler falls back to random sampling for any knob outside the always-active intersection.
DEFAULT_SAMPLER = "tpe"


def startup_trials(n_trials: int) -> int:
    """Random trials before the model is used: a third of the budget, between 3 and 10."""
    return max(3, min(10, n_trials // 3))


def make_sampler(name: str, space: SearchSpace, seed: int, n_trials: int) -> optuna.samplers.BaseSampler:
    if name not in SAMPLERS:
        raise ValueError(f"--sampler: expected one of {', '.join(SAMPLERS)}, got {name!r}")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        if name == "tpe":
            return optuna.samplers.TPESampler(seed=seed, multivariate=True, group=True,
                                              n_startup_trials=startup_trials(n_trials))
        if name == "gp":
            return optuna.samplers.GPSampler(seed=seed, n_startup_trials=startup_trials(n_trials),
                                             warn_independent_sampling=False)
        if name == "random":
            return optuna.samplers.RandomSampler(seed=seed)
    bad = [k.name for k in space.knobs if k.kind not in ("categorical", "bool") or k.when]
    if bad:
        raise ValueError(f"--sampler grid: every knob must be an unconditional categorical or bool, "
                         f"not {', '.join(bad)}")
    grid = {k.name: list(k.choices) if k.kind == "categorical" else [True, False] for k in space.knobs}
    return _Grid(grid, seed=seed)


class _Grid(optuna.samplers.GridSampler):
    """The grid, leaving the stop to the study loop: GridSampler calls `study.stop()` once every
    point was tried, which Optuna allows only inside `study.optimize`, not in ask-and-tell."""

    def after_trial(self, study, trial, state, values) -> None:
        pass
