"""The robustness benchmark's checks and its --rerun bookkeeping (no compare runs: run_once is replaced)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"


@pytest.fixture
def cul(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCH))
    import compare_under_load
    return compare_under_load


def _run(i, ratio, low, high, verdict="slower"):
    f = {"ratio": ratio, "ci": {"low": low, "high": high}, "verdict": verdict}
    return {"run": i, "answer": "a", "findings": {"hybrid-cache-gap": f, "naive": {**f, "verdict": "faster"}}}


def test_checks_pass_only_when_every_point_lies_in_every_ci(cul):
    ok = cul.verdicts_agree([_run(0, 1.35, 1.18, 1.55), _run(1, 1.26, 1.09, 1.45), _run(2, 1.31, 1.23, 1.39)])
    assert ok["same_verdict_per_stack"] and ok["gap_points_within_each_others_ci"]
    bad = cul.verdicts_agree([_run(0, 1.35, 1.18, 1.55), _run(1, 1.53, 1.15, 2.05), _run(2, 1.31, 1.23, 1.39)])
    assert bad["same_verdict_per_stack"] and not bad["gap_points_within_each_others_ci"]
    flip = cul.verdicts_agree([_run(0, 1.35, 1.18, 1.55), _run(1, 1.1, 0.9, 1.3, verdict="no significant difference")])
    assert not flip["same_verdict_per_stack"]


def test_rerun_replaces_only_the_named_run_and_keeps_it_as_discarded(cul, tmp_path, monkeypatch):
    out = tmp_path / "cul.json"
    out.write_text(json.dumps({"runs": [_run(0, 1.35, 1.18, 1.55), _run(1, 1.53, 1.15, 2.05),
                                        _run(2, 1.31, 1.23, 1.39), _run(3, 1.33, 1.16, 1.51)]}))
    calls = []

    def fake_run_once(i, busy, src, work, extra, max_s):
        calls.append((i, busy, src))
        return _run(i, 1.26, 1.09, 1.45)

    monkeypatch.setattr(cul, "run_once", fake_run_once)
    monkeypatch.setattr(sys, "argv", ["cul", "--rerun", "1", "--reason", "co-tenant above the condition",
                                      "--src", str(tmp_path), "--out", str(out), "--work", str(tmp_path / "w")])
    assert cul.main() == 0
    assert calls == [(1, True, tmp_path.resolve())]
    assert doc_src(out) == [None, str(tmp_path.resolve()), None, None]
    doc = json.loads(out.read_text())
    assert [r["findings"]["hybrid-cache-gap"]["ratio"] for r in doc["runs"]] == [1.35, 1.26, 1.31, 1.33]
    assert doc["discarded"][0]["findings"]["hybrid-cache-gap"]["ratio"] == 1.53
    assert doc["discarded"][0]["discarded_because"] == "co-tenant above the condition"
    assert doc["checks"]["gap_points_within_each_others_ci"] and len(doc["checks"]["gap_ratios"]) == 4


def test_rerun_needs_a_reason(cul, tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["cul", "--rerun", "1", "--out", str(tmp_path / "x.json")])
    with pytest.raises(SystemExit):
        cul.main()


def test_rerun_of_a_run_the_result_does_not_have_is_refused(cul, tmp_path, monkeypatch):
    out = tmp_path / "cul.json"
    out.write_text(json.dumps({"runs": [_run(0, 1.35, 1.18, 1.55)]}))
    monkeypatch.setattr(sys, "argv", ["cul", "--rerun", "3", "--reason", "r", "--out", str(out)])
    with pytest.raises(SystemExit):
        cul.main()


def doc_src(out):
    return [r.get("src") for r in json.loads(out.read_text())["runs"]]
