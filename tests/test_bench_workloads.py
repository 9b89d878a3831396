"""Each workload briefly against a server on 127.0.0.1 (the fake one, then real flashlane)."""

import json

import pytest

from bench_checks import check_run
from flashlane.bench.replay import BenchAbort
from flashlane.bench.runner import BenchConfig, build_source, run_bench
from flashlane.bench.workloads.fixed import FixedSpec
from flashlane.bench.workloads.multiturn import MultiTurnSpec


def cfg(url, tmp_path, **kw):
    base = dict(base_url=url, output_dir=str(tmp_path / "out"), progress=False, seed=3,
                scrape_interval_s=0.25, n_boot=200)
    base.update(kw)
    return BenchConfig(**base)


def test_agentic_sweep(server_url, is_fake, fake_server_session, tmp_path):
    c = cfg(server_url, tmp_path, workload="agentic", scale="small", concurrency=[1, 2],
            num_sessions=3, think_scale=0.3)
    res = run_bench(c)
    assert [d.name for _, _, d in res] == ["c1", "c2"]
    for f in ("report.html", "report.md", "sweep_summary.json"):
        assert (tmp_path / "out" / f).is_file()
    src = build_source(c)
    sent = 0
    for point, s, d in res:
        s, recs, sess = check_run(d, src)
        sent += len(recs)
        assert s["validity"]["valid"], s["validity"]
        assert s["sessions"]["completed"] == 3
        assert s["sessions"]["truncated"] + 3 == len(sess)
        assert s["cache"]["theoretical_hit_rate"] > 0
        assert s["telemetry"]["server_metrics"]  # /metrics was scraped
        if is_fake:  # the chat messages carry exactly the requested tokens (word approximation)
            assert all(r.input_tokens == r.requested_input_tokens for r in recs)
    if is_fake:  # every request the server saw is in requests.jsonl
        assert fake_server_session.state.count == sent


def test_multiturn_shared_prefix(server_url, is_fake, tmp_path):
    mt = MultiTurnSpec(turns=3, shared_prefix_tokens=128, first_user_tokens=32,
                       user_tokens_per_turn=16, output_tokens=(4, 8), think="fixed", think_mean_s=0.05)
    c = cfg(server_url, tmp_path, workload="multiturn", multiturn=mt, concurrency=[2], num_sessions=3)
    (_, s, d), = run_bench(c)
    s, recs, _ = check_run(d, build_source(c))
    assert len(recs) == 9 and s["requests"]["warmup"] == 0
    assert s["cache"]["theoretical_hit_rate"] > 0.5
    if is_fake:
        assert s["cache"]["prefix_cache_hit_rate"] > 0.5


def test_fixed_open_loop_with_warmup(server_url, is_fake, fake_server_session, tmp_path):
    c = cfg(server_url, tmp_path, workload="fixed", fixed=FixedSpec(32, 8), request_rates=[20.0],
            num_sessions=8, slo={"ttft_s": 10.0})
    (p, s, d), = run_bench(c)
    assert d.name == "out" and p.request_rate == 20.0
    s, recs, _ = check_run(d, build_source(c))
    assert s["requests"]["warmup"] == 2 and s["requests"]["sent"] == 8
    assert all(r.input_tokens >= 30 for r in recs if r.ok)
    assert json.loads((d / "manifest.json").read_text())["endpoint"] == "completions"
    assert s["goodput"]["requests"] == 8
    vllm = json.loads((d / "summary_vllm.json").read_text())
    assert vllm["completed"] == 8 and vllm["median_ttft_ms"] == pytest.approx(s["ttft_s"]["p50"] * 1000)
    starts = sorted(r.issue_time for r in recs if r.phase == "profiling")
    assert 0.05 < (starts[-1] - starts[0]) < 5.0  # Poisson arrivals spread the sends


def test_context_overflow_is_counted_not_dropped(server_url, is_fake, fake_server_session, tmp_path):
    if is_fake:
        fake_server_session.cfg.max_model_len = 8192
    trace = {"id": "overflow", "block_size": 64, "requests": [
        {"t": 0.0, "type": "n", "in": 40, "out": 4, "hash_ids": [1]},
        {"t": 0.1, "type": "n", "in": 20000, "out": 4, "hash_ids": []},
        {"t": 0.2, "type": "n", "in": 20100, "out": 4, "hash_ids": []}]}
    path = tmp_path / "overflow.json"
    path.write_text(json.dumps(trace))
    c = cfg(server_url, tmp_path, workload="agentic", trace=str(path), concurrency=[1],
            num_sessions=2, warmup="none", request_timeout_s=120)
    (_, s, d), = run_bench(c)
    s, recs, sess = check_run(d)
    # each session: turn 0 fine, turn 1 overflows and ends the session (turn 2 never sent)
    assert s["requests"]["sent"] == 4 and s["requests"]["failed"] == 2
    assert s["errors"]["by_class"] == {"context_overflow": 2}
    assert s["errors"]["context_overflow_rate"] == 0.5
    assert not s["validity"]["valid"] and any("overflow" in x for x in s["validity"]["reasons"])
    assert [t.ended_by for t in sess] == ["context_overflow"] * 2 and s["sessions"]["completed"] == 0
    assert s["tasks_per_hour"] == 0.0


def test_injected_server_errors_are_counted(fake_server, tmp_path):
    fake_server.cfg.error_every = 4
    c = cfg(fake_server.url, tmp_path, workload="fixed", fixed=FixedSpec(16, 4), concurrency=[2],
            num_sessions=10, warmup="none")
    (_, s, d), = run_bench(c)
    s, recs, _ = check_run(d, build_source(c))
    assert fake_server.state.count == len(recs) == 10
    assert s["errors"]["by_class"] == {"http_5xx": 2} and s["requests"]["completed"] == 8
    assert [r.http_status for r in recs if not r.ok] == [500, 500]
    assert s["sessions"]["completed"] == 8 and not s["validity"]["valid"]


def test_failed_root_warmup_aborts(fake_server, tmp_path):
    fake_server.cfg.error_every = 1
    c = cfg(fake_server.url, tmp_path, workload="agentic", scale="small", concurrency=[2],
            num_sessions=2, warmup="tstar", seed=5)
    with pytest.raises(BenchAbort, match="warmup"):
        run_bench(c)
    assert (tmp_path / "out" / "requests.jsonl").is_file()  # what was sent is still written


def test_live_mode_feeds_server_output_back(fake_server, tmp_path):
    fake_server.cfg.eos_prob = 0.3
    mt = MultiTurnSpec(turns=3, shared_prefix_tokens=16, first_user_tokens=8, user_tokens_per_turn=8,
                       output_tokens=(20, 20), think_mean_s=0.0)
    c = cfg(fake_server.url, tmp_path, workload="multiturn", multiturn=mt, concurrency=[1],
            num_sessions=3, mode="live")
    (_, s, d), = run_bench(c)
    s, recs, _ = check_run(d, mode="live")
    assert "degeneration" in s and s["degeneration"]["hit_max_tokens_rate"] < 1.0
    assert any(r.output_tokens < 20 for r in recs) and all(r.output_text is not None for r in recs)
    second = [b for b in fake_server.state.bodies if len(b["messages"]) == 4][0]
    assert second["messages"][2]["role"] == "assistant" and "tok" in second["messages"][2]["content"]
    assert "ignore_eos" not in second
