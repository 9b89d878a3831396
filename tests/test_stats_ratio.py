"""Ratio-of-means cluster bootstrap (compare's CI on every A/B ratio), and the verdicts built on it."""

import numpy as np
import pytest

from flashlane.bench.explain import explain_stacks, headline
from flashlane.bench.findings import FASTER, SAME, SLOWER, TOO_FEW, flips, point_finding, waterfall
from flashlane.bench.stats import ratio_of_means_ci


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
    few = point_finding("naive", 1, [20], [30])
    assert (slow.verdict, fast.verdict, few.verdict) == (SLOWER, FASTER, TOO_FEW)
    line = headline([few, slow, fast], "flash", "standard")
    assert line.startswith("hybrid-cache-gap reproduces the public finding's direction: flash is 2.01× slower")
    assert "95% CI" in line and "closed under flashlane (faster" in line


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
    assert any(line.startswith("From naive to hybrid-cache-gap: flash 50 → 50 s per task, standard 100.0 → 20 s")
               for line in text)
    from flashlane.bench.plots import ratio_waterfall
    assert ratio_waterfall(steps, "flash", "standard")[:4] == b"\x89PNG"


def test_a_busy_machine_marks_the_answer_noisy():
    quiet = point_finding("flashlane", 1, [20, 21, 19], [30, 31, 29])
    busy = point_finding("naive", 1, [20, 21, 19], [30, 31, 29], noisy=["other processes used 150% CPU of 200%"])
    assert "Noisy" not in headline([quiet], "flash", "standard")
    assert "busy during 1 of 2 comparisons" in headline([quiet, busy], "flash", "standard")
    assert any("noisy run: other processes used 150%" in line for line in explain_stacks([busy], "flash", "standard"))
