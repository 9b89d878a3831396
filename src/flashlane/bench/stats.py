"""Descriptive statistics: percentiles by linear interpolation (NumPy default, Hyndman-Fan 7),
duration-weighted means, and cluster bootstrap confidence intervals."""

from __future__ import annotations

import numpy as np

PERCENTILES = (50, 75, 90, 95, 99)
STAT_KEYS = ("n", "mean", "std", "min", "max") + tuple(f"p{p}" for p in PERCENTILES)


def describe(values, unit: str | None = None) -> dict:
    """n, mean, std (population, as vLLM), min, max, p50..p99; None entries when empty."""
    a = np.asarray([v for v in values if v is not None], dtype=float)
    out: dict = {"unit": unit} if unit else {}
    out["n"] = int(a.size)
    if a.size == 0:
        out.update({k: None for k in STAT_KEYS[1:]})
        return out
    out.update(mean=float(a.mean()), std=float(a.std()), min=float(a.min()), max=float(a.max()))
    for p, v in zip(PERCENTILES, np.percentile(a, PERCENTILES)):
        out[f"p{p}"] = float(v)
    return out


def bootstrap_ci(clusters: list[list[float]], stat: str = "mean", n_boot: int = 1000,
                 level: float = 0.95, seed: int = 0) -> dict | None:
    """CI of `stat` ('mean' or 'pNN') over values, resampling whole clusters (sessions) with
    replacement, since requests of one session are correlated."""
    clusters = [np.asarray(c, dtype=float) for c in clusters if len(c)]
    if len(clusters) < 2:
        return None
    rng = np.random.default_rng(seed)
    fn = _stat_fn(stat)
    k = len(clusters)
    sizes = np.array([c.size for c in clusters])
    if np.all(sizes == 1):  # fast path: one value per cluster
        flat = np.concatenate(clusters)
        samples = flat[rng.integers(0, k, size=(n_boot, k))]
        boots = np.array([fn(s) for s in samples])
    else:
        boots = np.array([fn(np.concatenate([clusters[i] for i in rng.integers(0, k, size=k)]))
                          for _ in range(n_boot)])
    lo, hi = np.percentile(boots, [(1 - level) / 2 * 100, (1 + level) / 2 * 100])
    return {"stat": stat, "level": level, "low": float(lo), "high": float(hi),
            "n_clusters": k, "n_boot": n_boot}


def ratio_of_means_ci(clusters_a: list[list[float]], clusters_b: list[list[float]],
                      n_boot: int = 2000, level: float = 0.95, seed: int = 0) -> dict | None:
    """Bootstrap CI of mean(A) / mean(B), each mean over all values of its clusters (sessions).
    A's and B's sessions are resampled independently (with replacement, whole sessions), since
    the two runs are separate samples; None when either side has fewer than 2 sessions or B's
    mean is not positive. `significant` is False when the interval spans 1."""
    a = [np.asarray(c, dtype=float) for c in clusters_a if len(c)]
    b = [np.asarray(c, dtype=float) for c in clusters_b if len(c)]
    if len(a) < 2 or len(b) < 2:
        return None
    point_b = float(np.concatenate(b).mean())
    if point_b <= 0:
        return None
    rng = np.random.default_rng(seed)
    boot_a = _cluster_mean_draws(a, n_boot, rng)
    boot_b = _cluster_mean_draws(b, n_boot, rng)
    keep = boot_b > 0
    ratios = boot_a[keep] / boot_b[keep]
    lo, hi = np.percentile(ratios, [(1 - level) / 2 * 100, (1 + level) / 2 * 100])
    return {"ratio": float(np.concatenate(a).mean()) / point_b, "low": float(lo), "high": float(hi),
            "level": level, "n_a": len(a), "n_b": len(b), "n_boot": n_boot,
            "significant": not (lo <= 1.0 <= hi)}


def _cluster_mean_draws(clusters: list[np.ndarray], n_boot: int, rng) -> np.ndarray:
    """n_boot bootstrap means: whole clusters drawn with replacement, mean over their values."""
    sums = np.array([c.sum() for c in clusters])
    sizes = np.array([c.size for c in clusters], dtype=float)
    idx = rng.integers(0, len(clusters), size=(n_boot, len(clusters)))
    return sums[idx].sum(axis=1) / sizes[idx].sum(axis=1)


def _stat_fn(stat: str):
    if stat == "mean":
        return np.mean
    if stat.startswith("p") and stat[1:].isdigit():
        q = int(stat[1:])
        return lambda a: np.percentile(a, q)
    raise ValueError(f"stat: expected 'mean' or 'pNN', got {stat!r}")


def step_time_average(intervals: list[tuple[float, float]], t0: float, t1: float) -> float:
    """Time-weighted average over [t0, t1] of the number of open intervals (in-flight count)."""
    if t1 <= t0:
        return 0.0
    total = 0.0
    for s, e in intervals:
        total += max(0.0, min(e, t1) - max(s, t0))
    return total / (t1 - t0)


def in_flight_series(intervals: list[tuple[float, float]]) -> tuple[np.ndarray, np.ndarray]:
    """Step function (times, counts) of how many intervals are open; count holds until next time."""
    events = sorted([(s, 1) for s, _ in intervals] + [(e, -1) for _, e in intervals],
                    key=lambda x: (x[0], x[1]))
    times, counts, c = [], [], 0
    for t, d in events:
        c += d
        if times and times[-1] == t:
            counts[-1] = c
        else:
            times.append(t)
            counts.append(c)
    return np.asarray(times, dtype=float), np.asarray(counts, dtype=int)


def paired_ratio_ci(a: list[float], b: list[float], level: float = 0.95) -> dict | None:
    """Ratio of paired samples (a[i], b[i] measured under the same conditions: the same task, back
    to back) as the geometric mean of the per-pair ratios, with a t interval on n - 1 degrees of
    freedom over their logarithms. Pairing cancels what both sides of a pair share (task size, the
    machine's load at the time) and the log makes a per-task ratio that holds across task sizes
    precise however much the sizes differ; the t quantile keeps a handful of pairs honest. None
    with fewer than 2 pairs or a non-positive value."""
    from scipy.stats import t as student_t

    if len(a) != len(b):
        raise ValueError(f"paired samples: {len(a)} vs {len(b)} values")
    x, y = np.asarray(a, dtype=float), np.asarray(b, dtype=float)
    n = x.size
    if n < 2 or (x <= 0).any() or (y <= 0).any():
        return None
    logs = np.log(x / y)
    mean, se = float(logs.mean()), float(logs.std(ddof=1)) / np.sqrt(n)
    half = float(student_t.ppf((1 + level) / 2, n - 1)) * se
    low, high = float(np.exp(mean - half)), float(np.exp(mean + half))
    return {"ratio": float(np.exp(mean)), "low": low, "high": high, "level": level, "n_pairs": n,
            "n_a": n, "n_b": n, "ratio_of_means": float(x.mean() / y.mean()),
            "method": "paired: geometric mean of per-pair ratios, t interval on the logs (n-1 df)",
            "significant": not (low <= 1.0 <= high)}


def keyed_ratio(a: dict, b: dict) -> float | None:
    """Geometric mean of a[k] / b[k] over the keys both hold with positive values (the same
    tasks on two sides, paired by id); None when there are none."""
    keys = [k for k in a if k in b and a[k] > 0 and b[k] > 0]
    if not keys:
        return None
    return float(np.exp(np.mean([np.log(a[k] / b[k]) for k in keys])))
