"""The AgentX sample trace replays with its turn structure: sub-agent spawned after the first
turn, the parent's next turn joined on it, think gaps honoured (end-to-start, scaled)."""

from pathlib import Path

import pytest

from bench_checks import check_run
from flashlane.bench.runner import BenchConfig, run_bench

SAMPLE = str(Path(__file__).parent / "data" / "agentx-sample-trace.json")
SCALE = 0.2
EARLY, LATE = 0.005, 0.25  # a gap may not start early; lateness = scheduling + a loaded CPU


def test_agentx_trace_replay_structure_and_timing(server_url, tmp_path):
    cfg = BenchConfig(base_url=server_url, output_dir=str(tmp_path / "run"), workload="agentic",
                      trace=SAMPLE, concurrency=[1], num_sessions=1, warmup="none",
                      think_scale=SCALE, progress=False, n_boot=100)
    (_, s, d), = run_bench(cfg)
    s, recs, sess = check_run(d)
    assert s["sessions"]["completed"] == 1 and s["requests"]["completed"] == 5
    (tree,) = sess
    assert tree.num_subagents == 1 and tree.num_requests == 5
    root = sorted([r for r in recs if r.session_id == "t0:root"], key=lambda r: r.turn_index)
    sub = sorted([r for r in recs if r.session_id == "t0:root/agent_001"], key=lambda r: r.turn_index)
    assert [r.turn_index for r in root] == [0, 1, 2] and [r.turn_index for r in sub] == [0, 1]
    assert all(r.parent_session_id == "t0:root" for r in sub)
    assert [r.requested_input_tokens for r in root] == [256, 384, 448]
    assert [r.requested_output_tokens for r in root + sub] == [16] * 5

    def gap_ok(after, before_end, expected):
        gap = after.send_time - before_end
        assert expected - EARLY <= gap <= expected + LATE, (gap, expected)

    # sub-agent: spawned 1.0 s after turn 0 ended, its first request 0.5 s after the spawn
    gap_ok(sub[0], root[0].end_time, SCALE * (1.0 + 0.5))
    gap_ok(sub[1], sub[0].end_time, SCALE * 1.0)
    # join: the parent's turn 1 waits for the sub-agent, then its 2.0 s think gap
    assert root[1].send_time > sub[1].end_time
    gap_ok(root[1], max(root[0].end_time, sub[1].end_time), SCALE * 2.0)
    gap_ok(root[2], root[1].end_time, SCALE * 3.0)
    assert [r.think_time_original_s for r in root] == pytest.approx([0.0, 2.0, 3.0])
    assert [r.think_time_s for r in root] == pytest.approx([0.0, 0.4, 0.6])
    # theoretical reuse: turn 1 reuses blocks 1-4 of turn 0, turn 2 blocks 1-6 of turn 1
    assert [r.theoretical_hit_blocks for r in root] == [0, 4, 6]
    assert [r.theoretical_hit_blocks for r in sub] == [0, 2]
    assert s["cache"]["theoretical_hit_rate"] == pytest.approx(12 / 22)
    # task time = model time + think/join time
    assert tree.model_time_s + tree.think_time_s == pytest.approx(tree.end_time - tree.start_time)
    assert tree.think_time_s >= SCALE * (2.0 + 3.0)


def test_think_cap_applies_before_scaling(fake_server, tmp_path):
    cfg = BenchConfig(base_url=fake_server.url, output_dir=str(tmp_path / "run"), workload="agentic",
                      trace=SAMPLE, concurrency=[1], num_sessions=1, warmup="none", think_cap_s=1.0,
                      think_scale=0.1, progress=False, telemetry=False, n_boot=100)
    (_, s, d), = run_bench(cfg)
    _, recs, _ = check_run(d)
    root = sorted([r for r in recs if r.session_id == "t0:root"], key=lambda r: r.turn_index)
    assert [r.think_time_s for r in root] == pytest.approx([0.0, 0.1, 0.1])
    assert [r.think_time_original_s for r in root] == pytest.approx([0.0, 2.0, 3.0])
