"""The bench's theoretical prefix-cache hit against the fake server's page-granular prefix cache:
for one conversation at a time a perfect cache reuses exactly the theoretical prefix, request by
request, in both replay modes."""

import json

import pytest

from bench_checks import check_run
from flashlane.bench.prefix_reuse import reusable_tokens
from flashlane.bench.runner import BenchConfig, run_bench
from flashlane.bench.workloads.multiturn import MultiTurnSpec

MT = MultiTurnSpec(turns=4, shared_prefix_tokens=40, first_user_tokens=20, user_tokens_per_turn=12,
                   output_tokens=(5, 9), think="fixed", think_mean_s=0.0)


def run(fake_server, tmp_path, mode, **kw):
    c = BenchConfig(base_url=fake_server.url, output_dir=str(tmp_path / mode), progress=False, seed=2,
                    workload="multiturn", multiturn=MT, concurrency=[1], num_sessions=3, mode=mode,
                    telemetry=False, n_boot=50, **kw)
    (_, s, d), = run_bench(c)
    s, recs, _ = check_run(d, mode=mode)  # also: the summary recomputes from the records
    return s, recs, json.loads((d / "manifest.json").read_text())


@pytest.mark.parametrize("mode", ["recorded", "live"])
def test_perfect_server_cache_reaches_the_theoretical_hit(fake_server, tmp_path, mode):
    fake_server.cfg.page_size = 8
    s, recs, manifest = run(fake_server, tmp_path, mode)
    assert manifest["page_size"] == 8 and manifest["page_size_source"] == "server /v1/models"
    reuse = reusable_tokens(recs, 8)
    assert len(recs) == 12 and all(r.ok for r in recs)
    assert [reuse[r.request_id] for r in recs] == [r.cached_tokens for r in recs]
    assert all(reuse[r.request_id] % 8 == 0 for r in recs)
    c = s["cache"]
    assert c["page_size"] == 8 and c["prefix_cache_hit_vs_theoretical"] == 1.0
    assert c["prefix_cache_hit_rate"] == c["prefix_cache_hit_rate_theoretical"] > 0.5
    # live answers are part of the reusable history, recorded (synthetic) ones are not
    assert all(r.output_fed_back == (mode == "live") for r in recs)


def test_page_size_override_wins_over_the_server_card(fake_server, tmp_path):
    fake_server.cfg.page_size = 8
    s, recs, manifest = run(fake_server, tmp_path, "recorded", page_size=32)
    assert manifest["page_size"] == 32 and manifest["page_size_source"] == "override"
    assert s["cache"]["page_size"] == 32
    # coarser pages than the server's: the server reuses at least as much as the bound
    assert s["cache"]["prefix_cache_hit_vs_theoretical"] >= 1.0
    assert all(reusable_tokens(recs, 32)[r.request_id] <= r.cached_tokens for r in recs)


def test_server_without_a_page_size_gets_the_default(fake_server, tmp_path):
    s, _, manifest = run(fake_server, tmp_path, "recorded")
    assert manifest["page_size"] == 16 and manifest["page_size_source"] == "default"
    assert s["cache"]["page_size"] == 16
