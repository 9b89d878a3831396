"""Interleaved rounds of `flashlane compare` and the measured attribution of a task's time:
the schedule, round sizes, engine time from step records, pooling, and the task partition."""

import json

import pytest

from flashlane.bench.attribution import COMPONENTS, mean_partition, task_partition
from flashlane.bench.load import LoadPoint
from flashlane.bench.machine_load import summarize_rounds
from flashlane.bench.records import RequestRecord, SessionRecord
from flashlane.bench.rounds import engine_time, merge_telemetry, round_sizes, schedule
from flashlane.bench.runner import BenchConfig


def cfg(**kw):
    base = dict(base_url="http://x", output_dir="o", concurrency=[1])
    base.update(kw)
    return BenchConfig(**base)


def test_schedule_alternates_abba():
    assert schedule(["a", "b"], 3) == [(0, "a"), (0, "b"), (1, "b"), (1, "a"), (2, "a"), (2, "b")]


def test_round_sizes_one_session_per_lane_else_a_few_rounds():
    assert round_sizes(cfg(num_sessions=3), LoadPoint(concurrency=1)) == [1, 1, 1]
    assert round_sizes(cfg(num_sessions=10, concurrency=[4]), LoadPoint(concurrency=4)) == [4, 4, 2]
    c = cfg(num_sessions=7, concurrency=None, request_rates=[0.5])
    assert round_sizes(c, LoadPoint(request_rate=0.5)) == [3, 3, 1]
    assert round_sizes(cfg(duration_s=30.0), LoadPoint(concurrency=2)) == [None]


def _steps(tmp_path, steps):
    (tmp_path / "telemetry").mkdir()
    (tmp_path / "telemetry" / "engine_steps.jsonl").write_text("".join(json.dumps(s) + "\n" for s in steps))


def test_engine_time_splits_steps_and_cuts_at_the_window(tmp_path):
    _steps(tmp_path, [{"start": 0.0, "end": 1.0, "model_s": 0.8, "sample_s": 0.1},
                      {"start": 2.0, "end": 4.0, "model_s": 1.0, "sample_s": 0.0},
                      {"start": 9.0, "end": 10.0, "model_s": 1.0, "sample_s": 0.0}])
    e = engine_time(tmp_path, 0.5, 3.0)   # half of the first step, half of the second, not the third
    assert e["steps"] == 2 and e["busy_s"] == pytest.approx(1.5)
    assert e["forward_s"] == pytest.approx(0.5 * 0.7 + 0.5 * 1.0) and e["sample_s"] == pytest.approx(0.05)
    assert e["overhead_s"] == pytest.approx(1.5 - 0.4 - 0.5)
    assert engine_time(tmp_path / "none", 0, 1) is None


def test_task_partition_tiles_the_task():
    # one task: request 1 in flight 0-4 s, a 3 s think, request 2 in flight 7.5-10 s
    sess = SessionRecord(tree_id="t0", trace_id="x", lane=0, completed=True,
                         start_time=0.0, end_time=10.0)
    reqs = [RequestRecord("r1", "s", "t0", send_time=0.0, end_time=4.0, think_time_s=0.0),
            RequestRecord("r2", "s", "t0", send_time=7.5, end_time=10.0, think_time_s=3.0)]
    steps = [{"start": 0.5, "end": 3.5, "model_s": 2.0, "sample_s": 0.5},    # 3 s inside request 1
             {"start": 5.0, "end": 6.0, "model_s": 1.0, "sample_s": 0.0},    # between requests: not the task's
             {"start": 8.0, "end": 9.0, "model_s": 0.5, "sample_s": 0.0}]
    p = task_partition(sess, reqs, steps)
    assert p["task_s"] == 10.0 and p["think_s"] == pytest.approx(3.0) and p["client_gap_s"] == pytest.approx(0.5)
    assert p["forward_s"] == pytest.approx(1.5 + 0.5) and p["sample_s"] == pytest.approx(0.5)
    assert p["overhead_s"] == pytest.approx(1.0 + 0.5)
    assert p["not_stepping_s"] == pytest.approx((4.0 - 3.0) + (2.5 - 1.0))
    assert sum(p[k] for k, _ in COMPONENTS) == pytest.approx(p["task_s"])
    m = mean_partition([p, p])
    assert m["tasks"] == 2 and m["sum_s"] == pytest.approx(10.0)


def test_pooled_telemetry_and_load_keep_each_round():
    gaps = lambda n, t: {"count": n, "total_s": t, "by_class": {  # noqa: E731
        "A": {"name": "a", "count": n, "total_s": t, "time_s": t}}}
    t = merge_telemetry([{"enabled": True, "busy_overall": 0.5, "idle_gaps": gaps(2, 1.0), "server_pid": 7},
                         {"enabled": True, "busy_overall": 1.0, "idle_gaps": gaps(1, 0.5)}], [10.0, 30.0])
    assert t["busy_overall"] == pytest.approx(0.875) and t["idle_gaps"]["count"] == 3
    assert t["idle_gaps"]["by_class"]["A"]["total_s"] == pytest.approx(1.5) and t["server_pid"] == 7
    m = summarize_rounds([{"n": 2, "cores": 2, "cotenant_cpu_percent": 10.0, "reasons": []},
                          {"n": 6, "cores": 2, "cotenant_cpu_percent": 90.0, "reasons": ["busy"]}])
    assert m["rounds"] == [10.0, 90.0] and m["cotenant_cpu_percent"] == pytest.approx(70.0)
    assert m["noisy"] and m["reasons"] == ["round 1: busy"]


def test_cotenant_cpu_counts_a_waited_child_as_ours():
    import subprocess
    import sys

    from flashlane.bench.machine_load import cotenant_cpu
    spin = "import time\nend = time.process_time() + 0.6\nwhile time.process_time() < end:\n    pass\n"
    with cotenant_cpu() as busy:
        subprocess.run([sys.executable, "-c", spin], check=True)
    # the child's 0.6 CPU-s are counted as ours (so they cannot show up as a co-tenant's), however
    # busy the rest of the machine is
    assert busy["ours_cpu_s"] >= 0.6 and busy["cotenant_cpu_percent"] >= 0
