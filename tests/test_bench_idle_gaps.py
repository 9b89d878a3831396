import pytest

from flashlane.bench.idle_gaps import busy_fractions, classify_gaps, detect_gaps, summarize_gaps


def timeline(pattern, dt=0.1):
    """pattern: string of '#' (busy 0.9) and '.' (idle 0.0), one sample per dt from t=0."""
    times = [i * dt for i in range(len(pattern) + 1)]
    values = [0.9] + [0.9 if ch == "#" else 0.0 for ch in pattern]
    return times, values


def test_detect_gaps_respects_threshold_and_minimum_length():
    t, v = timeline("###.####....###......")
    gaps = detect_gaps(t, v, threshold=0.05, min_gap_s=0.2)
    # the single idle sample (0.1 s) is too short; the 4- and 6-sample runs are gaps
    assert [(round(s, 2), round(e, 2)) for s, e in gaps] == [(0.8, 1.2), (1.5, 2.1)]
    assert detect_gaps(t, [x * 0 + 0.04 for x in v], threshold=0.05, min_gap_s=0.2) == [(0.0, t[-1])]
    assert detect_gaps(t, v, threshold=0.0, min_gap_s=0.2) == []
    with pytest.raises(ValueError):
        detect_gaps([0, 1], [0.0])


def test_classify_gaps_a_b_c():
    gaps = [(1.0, 2.0), (3.0, 4.0), (5.0, 6.0), (7.0, 8.0)]
    in_flight = [(2.9, 4.1), (4.9, 6.1), (7.0, 7.3)]  # nothing during gap 1
    waiting = [(3.5, 0.0), (5.5, 2.0), (7.5, 0.0)]  # queue only during gap 3
    out = classify_gaps(gaps, in_flight, waiting, waiting_tolerance_s=0.2)
    assert [g["cls"] for g in out] == ["A", "B", "C", "A"]
    assert out[0]["a_s"] == pytest.approx(1.0) and out[0]["b_s"] == 0.0
    assert out[1]["b_s"] == pytest.approx(1.0) and out[1]["a_s"] == pytest.approx(0.0)
    assert out[2]["c_s"] == pytest.approx(1.0)
    # gap 4: 0.3 s in flight (B), 0.7 s nothing in flight (A) -> labelled A, split kept
    assert out[3]["a_s"] == pytest.approx(0.7) and out[3]["b_s"] == pytest.approx(0.3)
    s = summarize_gaps(out, window_s=10.0)
    assert s["count"] == 4 and s["total_s"] == pytest.approx(4.0)
    assert s["by_class"]["A"]["count"] == 2 and s["by_class"]["B"]["count"] == 1
    assert s["by_class"]["C"]["count"] == 1
    assert s["by_class"]["B"]["time_s"] == pytest.approx(1.3)
    assert s["idle_fraction"] == pytest.approx(0.4)
    assert sum(s["by_class"]["A"]["histogram"].values()) == 2


def test_classify_gap_queue_seen_by_a_scrape_just_outside_the_gap():
    out = classify_gaps([(1.0, 1.3)], [(0.0, 2.0)], [(1.6, 3.0)], waiting_tolerance_s=0.5)
    assert out[0]["cls"] == "C"
    out = classify_gaps([(1.0, 1.3)], [(0.0, 2.0)], [(2.6, 3.0)], waiting_tolerance_s=0.5)
    assert out[0]["cls"] == "B"


def test_busy_fractions_overall_and_conditional_on_in_flight():
    t, v = timeline("####......")  # busy for the first 0.4 s
    bf = busy_fractions(t, v, [(0.0, 0.4)])
    assert bf["overall"] == pytest.approx(0.9 * 0.4)
    assert bf["when_in_flight"] == pytest.approx(0.9)
    assert busy_fractions([0.0], [1.0], [])["overall"] is None
