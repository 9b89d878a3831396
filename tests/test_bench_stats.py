import numpy as np
import pytest

from flashlane.bench.stats import (bootstrap_ci, describe, in_flight_series, step_time_average)


def test_describe_matches_numpy_linear_interpolation():
    rng = np.random.default_rng(3)
    v = rng.lognormal(size=137)
    d = describe(v.tolist(), "s")
    assert d["unit"] == "s" and d["n"] == 137
    for p in (50, 75, 90, 95, 99):
        assert d[f"p{p}"] == pytest.approx(np.percentile(v, p), rel=0, abs=0)
    assert d["mean"] == pytest.approx(v.mean()) and d["std"] == pytest.approx(v.std())
    assert d["min"] == v.min() and d["max"] == v.max()


def test_describe_small_and_empty_and_none_values():
    d = describe([1.0, None, 3.0])
    assert d["n"] == 2 and d["p50"] == 2.0 and d["p90"] == pytest.approx(2.8)
    e = describe([])
    assert e["n"] == 0 and e["mean"] is None and e["p99"] is None


def test_bootstrap_ci_over_clusters_is_deterministic_and_brackets_the_estimate():
    rng = np.random.default_rng(0)
    clusters = [list(rng.normal(loc=10 + i % 3, size=5)) for i in range(30)]
    a = bootstrap_ci(clusters, "mean", n_boot=300, seed=1)
    b = bootstrap_ci(clusters, "mean", n_boot=300, seed=1)
    assert a == b
    mean = np.mean(np.concatenate(clusters))
    assert a["low"] < mean < a["high"] and a["n_clusters"] == 30
    p90 = bootstrap_ci([[x] for x in range(100)], "p90", n_boot=300, seed=1)
    assert p90["low"] <= np.percentile(range(100), 90) <= p90["high"]
    assert bootstrap_ci([[1.0]], "mean") is None
    with pytest.raises(ValueError, match="stat"):
        bootstrap_ci([[1.0], [2.0]], "median")


def test_in_flight_step_function_and_time_average():
    iv = [(0.0, 2.0), (1.0, 3.0), (5.0, 6.0)]
    t, c = in_flight_series(iv)
    assert t.tolist() == [0.0, 1.0, 2.0, 3.0, 5.0, 6.0]
    assert c.tolist() == [1, 2, 1, 0, 1, 0]
    assert step_time_average(iv, 0.0, 6.0) == pytest.approx(5.0 / 6.0)
    assert step_time_average(iv, 1.0, 2.0) == pytest.approx(2.0)
