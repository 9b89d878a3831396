"""Token-level prefix-cache hit rates: server-reported vs theoretical (page-granular perfect cache)."""

import pytest

from flashlane.bench.metrics import SummaryParams, compute_summary
from flashlane.bench.prefix_reuse import (DEFAULT_PAGE_SIZE, page_size_of, prefix_cache_rates,
                                          resolve_page_size, reusable_tokens)
from flashlane.bench.records import PHASE_WARMUP, STATUS_ERROR, RequestRecord
from flashlane.bench.report_rows import run_rows, sweep_rows


def rec(rid, inp, out=10, *, extends=None, fed=False, cached=None, shared=0, send=0.0, first=None,
        phase="profiling", ok=True):
    return RequestRecord(request_id=rid, session_id=rid.split(":")[0], tree_id="t", phase=phase,
                         status="ok" if ok else STATUS_ERROR, input_tokens=inp if ok else None,
                         output_tokens=out if ok else None, cached_tokens=cached, usage_reported=ok,
                         extends_request_id=extends, output_fed_back=fed, shared_prefix_tokens=shared,
                         issue_time=send, send_time=send,
                         first_token_time=first if first is not None else send + 0.1,
                         end_time=send + 0.5)


def test_live_history_is_prompt_plus_output_minus_one_rounded_to_pages():
    recs = [rec("a:0", 100, 20, fed=True), rec("a:1", 150, 10, extends="a:0", fed=True),
            rec("a:2", 200, extends="a:1", fed=True)]
    # 100 + 20 - 1 = 119 -> 112; 150 + 10 - 1 = 159 -> 144
    assert reusable_tokens(recs, 16) == {"a:0": 0, "a:1": 112, "a:2": 144}
    assert reusable_tokens(recs, 1) == {"a:0": 0, "a:1": 119, "a:2": 159}
    rates = prefix_cache_rates(recs, 16)
    assert rates["prefix_cache_hit_rate_theoretical"] == pytest.approx(256 / 450)
    assert rates["prompt_tokens"] == 450 and rates["theoretical_reusable_tokens"] == 256


def test_recorded_answer_is_synthetic_so_only_the_prompt_is_reusable():
    recs = [rec("a:0", 100, 20), rec("a:1", 150, extends="a:0")]
    assert reusable_tokens(recs, 16)["a:1"] == 96


def test_reuse_is_capped_one_below_the_prompt():
    recs = [rec("a:0", 100, 50, fed=True), rec("a:1", 120, extends="a:0")]
    assert reusable_tokens(recs, 1)["a:1"] == 119
    assert reusable_tokens(recs, 16)["a:1"] == 112
    same = [rec("a:0", 64), rec("a:1", 64, extends="a:0")]  # the same prompt again
    assert reusable_tokens(same, 16)["a:1"] == 48


def test_failed_request_is_skipped_in_the_lineage():
    recs = [rec("a:0", 100, 20, fed=True), rec("a:1", 0, extends="a:0", ok=False),
            rec("a:2", 200, extends="a:1")]
    assert reusable_tokens(recs, 16) == {"a:0": 0, "a:2": 112}


def test_shared_system_prompt_counts_once_another_request_finished_prefill():
    recs = [rec("a:0", 100, shared=70, send=0.0, first=1.0),
            rec("b:0", 90, shared=70, send=0.5),  # sent before a:0's prefill ended: nothing cached
            rec("c:0", 90, shared=40, send=2.0),  # shares min(40, 70)
            rec("d:0", 90, shared=70, send=2.0),
            rec("e:0", 80, send=3.0)]  # no system prompt (a sub-agent)
    assert reusable_tokens(recs, 16) == {"a:0": 0, "b:0": 0, "c:0": 32, "d:0": 64, "e:0": 0}


def test_warmup_fills_the_cache_but_is_not_counted():
    recs = [rec("a:3:w", 400, 20, fed=True, phase=PHASE_WARMUP, cached=0),
            rec("a:4", 500, extends="a:3:w", fed=True, cached=400)]
    rates = prefix_cache_rates(recs, 16)
    assert rates["prompt_tokens"] == 500 and rates["theoretical_reusable_tokens"] == 416
    assert rates["prefix_cache_hit_rate"] == pytest.approx(400 / 500)
    assert rates["prefix_cache_hit_rate_theoretical"] == pytest.approx(416 / 500)
    assert rates["prefix_cache_hit_vs_theoretical"] == pytest.approx(400 / 416)


def test_server_reported_rate_and_ratio_use_the_reporting_requests():
    recs = [rec("a:0", 100, 20, fed=True, cached=0), rec("a:1", 150, extends="a:0", cached=96),
            rec("b:0", 50, cached=None), rec("b:1", 70, extends="b:0", ok=False)]
    rates = prefix_cache_rates(recs, 16)
    assert rates["requests_reporting_cached_tokens"] == 2
    assert rates["cached_tokens"] == 96
    assert rates["prefix_cache_hit_rate"] == pytest.approx(96 / 250)
    assert rates["prefix_cache_hit_rate_theoretical"] == pytest.approx(112 / 300)
    assert rates["prefix_cache_hit_vs_theoretical"] == pytest.approx(96 / 112)


def test_rates_without_cached_tokens_or_reuse_are_none():
    rates = prefix_cache_rates([rec("a:0", 100)], 16)
    assert rates["prefix_cache_hit_rate"] is None and rates["cached_tokens"] is None
    assert rates["prefix_cache_hit_rate_theoretical"] == 0.0
    assert prefix_cache_rates([rec("a:0", 100, cached=0)], 16)["prefix_cache_hit_vs_theoretical"] is None
    empty = prefix_cache_rates([], 16)
    assert empty["prefix_cache_hit_rate"] is None and empty["prefix_cache_hit_rate_theoretical"] is None


def test_page_size_comes_from_override_then_server_card_then_default():
    card = {"data": [{"id": "m", "flashlane": {"page_size": 64}}]}
    assert page_size_of(card) == 64
    assert resolve_page_size(None, card) == (64, "server /v1/models")
    assert resolve_page_size(32, card) == (32, "override")
    for doc in (None, {"data": []}, {"data": [{"id": "vllm-model"}]},
                {"data": [{"flashlane": {"page_size": 0}}]}, {"data": [{"flashlane": {"page_size": True}}]}):
        assert resolve_page_size(None, doc) == (DEFAULT_PAGE_SIZE, "default")
    with pytest.raises(ValueError, match="page_size"):
        resolve_page_size(0, card)
    with pytest.raises(ValueError, match="page_size"):
        SummaryParams(page_size=0)


def test_summary_and_report_rows_show_both_rates():
    recs = [rec("a:0", 100, 20, fed=True, cached=0, send=0.0),
            rec("a:1", 150, extends="a:0", cached=96, send=1.0)]
    s = compute_summary(recs, [], 0.0, 2.0, SummaryParams(concurrency=1, page_size=16, n_boot=10))
    c = s["cache"]
    assert c["page_size"] == 16
    assert c["prefix_cache_hit_rate"] == pytest.approx(96 / 250)
    assert c["prefix_cache_hit_rate_theoretical"] == pytest.approx(112 / 250)
    assert c["prefix_cache_hit_vs_theoretical"] == pytest.approx(96 / 112)
    row = dict(run_rows(s))["prefix-cache hit (tokens)"]
    assert "server-reported 0.384" in row and "theoretical 0.448 (page 16)" in row and "÷ theoretical 0.857" in row
    head, rows = sweep_rows([("c1", s)])
    line = dict(zip(head, rows[0]))
    assert line["cache hit"] == "0.384" and line["cache hit theor."] == "0.448"
