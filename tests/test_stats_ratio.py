"""Ratio-of-means cluster bootstrap (compare's CI on every A/B ratio), and the verdicts built on it."""

import numpy as np
import pytest

from flashlane.bench.explain import explain_stacks, headline
from flashlane.bench.findings import (FASTER, SAME, SLOWER, TOO_FEW, disagreement, flips, paired_finding,
                                      point_finding, waterfall)
from flashlane.bench.stats import paired_ratio_ci, ratio_of_means_ci


def direct_ratio_ci(a, b, n_boot, seed, level=0.95):
    """The textbook loop: draw whole sessions of A, then of B, with replacement; ratio of means."""
    rng = np.random.default_rng(seed)
    ia = rng.integers(0, len(a), size=(n_boot, len(a)))
    ib = rng.integers(0, len(b), size=(n_boot, len(b)))
    ratios = []
    for k in range(n_boot):
        va = np.concatenate([a[i] for i in ia[k]])
        vb = np.concatenate([b[i] for i in ib[k]])
        ratios.append(va.mean() / vb.mean())
    return np.percentile(ratios, [(1 - level) / 2 * 100, (1 + level) / 2 * 100])


def sessions(rng, n, mean, sizes=(1, 6)):
    return [list(rng.normal(mean, 0.3 * mean, size=rng.integers(*sizes)).clip(0.01)) for _ in range(n)]


def test_ratio_ci_matches_direct_resampling_of_sessions():
    rng = np.random.default_rng(7)
    a, b = sessions(rng, 9, 20.0), sessions(rng, 11, 10.0)
    ci = ratio_of_means_ci(a, b, n_boot=500, seed=3)
    lo, hi = direct_ratio_ci([np.asarray(x) for x in a], [np.asarray(x) for x in b], 500, 3)
    assert ci["low"] == pytest.approx(lo, rel=1e-9) and ci["high"] == pytest.approx(hi, rel=1e-9)
    point = np.concatenate(a).mean() / np.concatenate(b).mean()
    assert ci["ratio"] == pytest.approx(point)
    assert ci["low"] < point < ci["high"] and ci["n_a"] == 9 and ci["n_b"] == 11
    assert ci["significant"] and ci["low"] > 1  # A is about twice B


def test_ratio_ci_needs_two_sessions_each():
    assert ratio_of_means_ci([[1.0]], [[1.0], [2.0]]) is None
    assert ratio_of_means_ci([[1.0], [2.0]], [[0.0], [0.0]]) is None


def test_overlapping_runs_give_no_significant_difference():
    rng = np.random.default_rng(1)
    a, b = list(rng.normal(30, 8, 8)), list(rng.normal(31, 8, 8))
    f = point_finding("flashlane", 1, a, b, n_boot=1000)
    assert f.ci["low"] < 1 < f.ci["high"] and f.verdict == SAME
    text = explain_stacks([f], "flash", "standard")
    assert any("no significant difference" in line and "CI spans 1" in line for line in text)
    assert text[0].startswith("No stack reproduces")


def test_verdicts_and_headline_name_the_reproducing_stack():
    slow = point_finding("hybrid-cache-gap", 1, [60, 62, 58, 61], [30, 31, 29, 30])
    fast = point_finding("flashlane", 1, [20, 21, 19, 20], [30, 31, 29, 30])
    few = point_finding("tiny", 1, [20], [30])
    assert (slow.verdict, fast.verdict, few.verdict) == (SLOWER, FASTER, TOO_FEW)
    # naive is faster too, but by slowing the standard model down (no cache for either): the
    # answer names the stack that makes the hybrid itself fast
    naive = point_finding("naive", 1, [50, 52, 48, 51], [90, 91, 89, 90])
    line = headline([few, naive, slow, fast], "flash", "standard",
                    mechanisms={"flashlane": "prefix caching for the hybrid too"})
    assert line.startswith("At concurrency 1, hybrid-cache-gap reproduces the public finding: flash is 2.01× "
                           "(95% CI ")
    # the closing stack, its mechanism and its ratio with CI, at the same stated load point
    assert "; flashlane closes it with prefix caching for the hybrid too: 0.67× (95% CI " in line
    assert line.endswith("the hybrid faster.")


def test_headline_with_paired_rounds_says_whether_engine_time_agrees():
    pairs = [(40.0, 30.0), (41.0, 30.5), (39.0, 29.0)]
    agree = paired_finding("hybrid-cache-gap", 1, [40, 41, 39], [30, 30.5, 29], pairs,
                           engine_pairs=[(30.0, 20.0), (31.0, 20.5), (29.0, 19.0)])
    assert agree.verdict == SLOWER and agree.ci["method"].startswith("paired")
    assert "give the same verdicts" in headline([agree], "flash", "standard")
    # the engine's own time says the opposite: the answer says so instead of picking one
    split = paired_finding("hybrid-cache-gap", 1, [40, 41, 39], [30, 30.5, 29], pairs,
                           engine_pairs=[(20.0, 30.0), (20.5, 31.0), (19.0, 29.0)])
    assert disagreement(split) == "engine busy time says faster (0.66×)"
    line = headline([split], "flash", "standard", unequal=["dtype bfloat16 vs float32"])
    assert "The engine's own time disagrees (hybrid-cache-gap: engine busy time says faster" in line
    assert "Unequal serving conditions (dtype bfloat16 vs float32)" in line


def test_a_flip_between_load_points_is_stated():
    c1 = point_finding("naive", 1, [40, 42, 41, 39], [30, 31, 29, 30])
    c2 = point_finding("naive", 2, [25, 24, 26, 25], [30, 31, 29, 30])
    c4 = point_finding("naive", 4, [20, 21, 19, 20], [30, 31, 29, 30])
    assert [(a.load, b.load) for a, b in flips([c4, c1, c2])] == [(1, 2)]
    text = explain_stacks([c1, c2, c4], "flash", "standard")
    flip = [line for line in text if "flips" in line]
    assert len(flip) == 1 and "concurrency 1 (1.35×) and 2 (0.83×); both significant" in flip[0]
    assert any(line.startswith("Under naive at concurrency 1, flash is slower") for line in text)
    assert any(line.startswith("Under naive at concurrency 2, flash is faster") for line in text)


def test_waterfall_steps_on_synthetic_results():
    runs = [("naive", point_finding("naive", 1, [50, 50], [100, 100])),
            ("hybrid-cache-gap", point_finding("hybrid-cache-gap", 1, [50, 50], [20, 20])),
            ("flashlane", point_finding("flashlane", 1, [10, 10], [20, 20]))]
    steps = waterfall(runs)
    assert [s["stack"] for s in steps] == ["naive", "hybrid-cache-gap", "flashlane"]
    assert [s["ratio"] for s in steps] == pytest.approx([0.5, 2.5, 0.5])
    assert steps[0]["d_ratio"] is None
    assert steps[1]["d_standard_s"] == pytest.approx(-80) and steps[1]["d_hybrid_s"] == pytest.approx(0)
    assert steps[2]["d_hybrid_s"] == pytest.approx(-40) and steps[2]["d_ratio"] == pytest.approx(-2.0)
    text = explain_stacks([f for _, f in runs], "flash", "standard", steps=steps)
    assert any(line.startswith("From naive to hybrid-cache-gap at concurrency 1: flash 50 → 50 s per task, "
                               "standard 100.0 → 20 s")
               for line in text)
    from flashlane.bench.plots import ratio_waterfall
    assert ratio_waterfall(steps, "flash", "standard")[:4] == b"\x89PNG"


def test_a_busy_machine_marks_the_answer_noisy():
    quiet = point_finding("flashlane", 1, [20, 21, 19], [30, 31, 29])
    busy = point_finding("naive", 1, [20, 21, 19], [30, 31, 29], noisy=["other processes used 150% CPU of 200%"])
    assert "Noisy" not in headline([quiet], "flash", "standard")
    assert "co-tenants were busy during 1 of 2 comparisons" in headline([quiet, busy], "flash", "standard")
    assert any("noisy rounds: other processes used 150%" in line
               for line in explain_stacks([busy], "flash", "standard"))


def test_paired_ratio_ci_is_a_t_interval_on_the_log_ratios():
    from scipy import stats
    a, b = [45.4, 38.2, 38.5, 40.1], [30.4, 27.9, 29.4, 28.8]
    ci = paired_ratio_ci(a, b)
    logs = np.log(np.array(a) / np.array(b))
    lo, hi = stats.t.interval(0.95, len(a) - 1, loc=logs.mean(), scale=stats.sem(logs))
    assert (ci["low"], ci["ratio"], ci["high"]) == pytest.approx((np.exp(lo), np.exp(logs.mean()), np.exp(hi)))
    assert ci["ratio_of_means"] == pytest.approx(sum(a) / sum(b)) and ci["n_pairs"] == 4 and ci["significant"]


def test_paired_ratio_ci_covers_the_true_ratio_about_95_percent_under_shared_drift():
    # each pair shares a task size and a machine slowdown (up to 2x); the true per-task ratio is 1.3
    rng = np.random.default_rng(7)
    hits, widths, trials = 0, [], 600
    for _ in range(trials):
        size = rng.uniform(20, 60, 4) * rng.uniform(0.7, 1.6, 4)
        b = size * rng.lognormal(0, 0.03, 4)
        a = 1.3 * size * rng.lognormal(0, 0.03, 4)
        ci = paired_ratio_ci(list(a), list(b))
        hits += ci["low"] <= 1.3 <= ci["high"]
        widths.append(ci["high"] / ci["low"])
    assert 0.91 <= hits / trials <= 0.99
    # unpaired, the same data's task-size spread would swamp the ratio; paired, it stays tight
    assert np.median(widths) < 1.15


def test_paired_ratio_ci_edge_cases():
    assert paired_ratio_ci([1.0], [1.0]) is None
    assert paired_ratio_ci([1.0, 2.0], [0.0, 1.0]) is None
    with pytest.raises(ValueError, match="paired samples: 2 vs 3"):
        paired_ratio_ci([1.0, 2.0], [1.0, 2.0, 3.0])
    wide = paired_ratio_ci([1.0, 2.0], [2.0, 1.0])   # two pairs that disagree: the CI spans 1
    assert wide["low"] < 1 < wide["high"] and not wide["significant"]
