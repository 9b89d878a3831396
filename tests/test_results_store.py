"""The results store: runs recorded from their output folders, `flashlane history` listing and
trends, `history check` on regressions, and the schema version guard."""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path

import pytest

from bench_fixtures import run_cli
from flashlane.cli.main import main
from flashlane.results.record import record_run
from flashlane.results.store import ResultsStore, SchemaError


def summary(tph: float, lat_mean: float, lat_ci: tuple[float, float], p90: float, c: int = 2) -> dict:
    return {"load_point": {"concurrency": c, "request_rate": None}, "tasks_per_hour": tph,
            "task_latency_s": {"mean": lat_mean, "p90": p90}, "ttft_s": {"mean": 0.1, "p90": 0.2},
            "errors": {"rate": 0.0}, "throughput": {"output_tok_s": 50.0},
            "confidence_intervals": {"task_latency_mean": {"low": lat_ci[0], "high": lat_ci[1]},
                                     "task_latency_p90": {"low": p90 * 0.9, "high": p90 * 1.1}}}


def write_point(d: Path, s: dict, model: str = "tiny-flash", owned_by: str = "flashlane") -> Path:
    d.mkdir(parents=True)
    (d / "summary.json").write_text(json.dumps(s))
    (d / "manifest.json").write_text(json.dumps({
        "model": model, "workload": {"workload": "agentic", "scale": "small"}, "argv": ["flashlane", "bench"],
        "server_models": {"data": [{"id": model, "owned_by": owned_by}]}}))
    return d


@pytest.fixture
def db(tmp_path):
    """Three bench runs: a baseline, the same again, and a slower one (its CI clear of the baseline's)."""
    path = tmp_path / "results.db"
    for i, (tph, mean, ci) in enumerate([(1000.0, 7.2, (6.8, 7.6)), (990.0, 7.3, (6.9, 7.7)),
                                          (500.0, 14.4, (13.6, 15.2))]):
        record_run(path, "bench", write_point(tmp_path / f"run{i}", summary(tph, mean, ci, 2 * mean)))
    record_run(path, "bench", write_point(tmp_path / "other", summary(50.0, 3.0, (2.0, 4.0), 6.0),
                                          model="smollm2-135m", owned_by="vllm"))
    return path


def test_runs_are_listed_and_filtered(db, capsys):
    assert main(["history", "--results-db", str(db)]) == 0
    out = capsys.readouterr().out
    assert out.count("| bench ") == 4 and "agentic/small" in out and "smollm2-135m" in out
    assert main(["history", "--results-db", str(db), "--stack", "vllm"]) == 0
    out = capsys.readouterr().out
    assert out.count("| bench ") == 1 and "smollm2-135m" in out
    assert main(["history", "--results-db", str(db), "--model", "tiny-flash", "--metric", "tasks_per_hour"]) == 0
    out = capsys.readouterr().out
    assert out.count("| c2 ") == 3 and "-49.5%" in out and "higher is better" in out
    with ResultsStore(db) as store:
        (p,) = store.points(store.resolve("latest~1"))
        lo, hi = p.metrics["tasks_per_hour"][1:]
        assert lo < 500.0 < hi  # tasks/hour CI from the mean task latency's (Little's law)


def test_check_flags_a_regression_and_passes_an_unchanged_metric(db, capsys):
    base = ["history", "check", "--results-db", str(db), "--baseline", "1"]
    assert main(base + ["--candidate", "2"]) == 0
    assert capsys.readouterr().out.startswith("ok: tasks_per_hour")
    assert main(base + ["--candidate", "3"]) == 1
    assert "REGRESSION: tasks_per_hour at c2" in capsys.readouterr().out
    assert main(base + ["--candidate", "3", "--metric", "p90_task_latency"]) == 1
    assert main(base + ["--candidate", "2", "--metric", "p90_task_latency"]) == 0
    assert main(base + ["--candidate", "9"]) == 2
    assert "no run with id 9" in capsys.readouterr().err


def test_a_newer_schema_is_refused(tmp_path, capsys):
    path = tmp_path / "results.db"
    ResultsStore(path).close()
    with sqlite3.connect(path) as con:
        con.execute("PRAGMA user_version = 99")
    with pytest.raises(SchemaError, match="schema version 99 is newer"):
        ResultsStore(path)
    assert main(["history", "--results-db", str(path)]) == 2
    assert "newer than this flashlane understands" in capsys.readouterr().err


def test_bench_registers_its_run_unless_told_not_to(fake_server, tmp_path):
    db = tmp_path / "results.db"
    common = ["bench", "--base-url", fake_server.url, "--scale", "small", "--concurrency", "1",
              "--num-sessions", "1", "--no-telemetry", "--no-progress", "--results-db", str(db)]
    r = run_cli(common + ["--output-dir", str(tmp_path / "a")])
    assert r.returncode == 0, r.stderr
    assert "recorded as run 1" in r.stderr
    r = run_cli(common + ["--output-dir", str(tmp_path / "b"), "--no-record"])
    assert r.returncode == 0, r.stderr
    with ResultsStore(db) as store:
        (run,) = store.runs()
        assert (run.kind, run.model, run.workload) == ("bench", "fake-model", "agentic/small")
        assert store.points(run.id)[0].metrics["tasks_per_hour"][0] > 0


def test_a_three_stack_compare_lists_its_stacks_and_whole_point_names(tmp_path, capsys):
    out = tmp_path / "compare"
    stacks = ["naive", "hybrid-cache-gap", "flashlane"]
    for stack in stacks:   # every stack is a `flashlane serve`: each point's server says "flashlane"
        for model in ("tiny-flash", "tiny-standard"):
            write_point(out / stack / model / "c1", summary(900.0, 8.0, (7.5, 8.5), 16.0, c=1), model=model)
    (out / "compare.json").write_text(json.dumps({"stacks": [{"name": s} for s in stacks]}))
    db = tmp_path / "results.db"
    record_run(db, "compare", out)
    assert main(["history", "--results-db", str(db)]) == 0
    listed = capsys.readouterr().out
    assert "| naive,hybrid-cache-gap,flashlane |" in listed and listed.count("| compare ") == 1
    for stack in stacks:
        for model in ("tiny-flash", "tiny-standard"):
            assert f"{stack}/{model}/c1" in listed   # wrapped onto further rows, never cut


def test_a_trend_draws_one_sparkline_per_model_workload_and_point(db, capsys):
    assert main(["history", "--results-db", str(db), "--metric", "tasks_per_hour"]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    # tiny-flash 1000 -> 990 -> 500 on its own scale; smollm2-135m's 50 tasks/h is another line
    assert "  █▇▁  tiny-flash agentic/small c2 (3 runs)" in lines
    assert "  ▁  smollm2-135m agentic/small c2 (1 run)" in lines
    assert out.count("(lower is better)") + out.count("(higher is better)") == 1


def test_a_simulated_run_gets_its_own_sparkline_and_kind_filter(db, tmp_path, capsys):
    """`flashlane simulate` records its runs as kind "simulate": they never continue the measured
    series of the same model and point, and `--kind simulate` lists them alone."""
    record_run(db, "simulate", write_point(tmp_path / "sim", summary(2000.0, 3.6, (3.6, 3.6), 7.2)))
    assert main(["history", "--results-db", str(db), "--metric", "tasks_per_hour"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert "  █▇▁  tiny-flash agentic/small c2 (3 runs)" in lines
    assert "  ▁  tiny-flash simulated agentic/small c2 (1 run)" in lines
    assert main(["history", "--results-db", str(db), "--kind", "simulate"]) == 0
    out = capsys.readouterr().out
    assert out.count("| simulate ") == 1 and "| bench " not in out
