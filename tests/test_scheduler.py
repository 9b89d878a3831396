"""Scheduler rules on a real cache manager (no model)."""

import pytest

from flashlane.cache_spec import cache_spec
from flashlane.config import parse_config
from flashlane.engine.cache.manager import CacheManager, plan_cache
from flashlane.engine.request import Request
from flashlane.engine.runner import SeqResult
from flashlane.engine.sampling_params import SamplingParams
from flashlane.engine.scheduler import Scheduler
import torch

CFG = parse_config(dict(model_type="llama", vocab_size=256, hidden_size=64, intermediate_size=128,
                        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2))


def _sched(num_pages=64, budget=256, max_seqs=8, wait_ms=0.0):
    spec = cache_spec(CFG, 16)
    plan = plan_cache(spec, torch.float32, 10**7, max_seqs, num_pages=num_pages)
    return Scheduler(CacheManager(spec, plan, torch.float32), max_seqs, budget, 64, wait_ms)


def _req(i, n, t=0.0):
    return Request(f"r{i}", list(range(3, 3 + n)), SamplingParams(max_tokens=8), arrival_time=t)


def _advance(sched, out):
    for s in out.seqs:
        samples = s.samples
        s.req.num_computed_tokens += s.num_new
        if samples:
            s.req.output_token_ids.append(7)


def test_budget_chunks_and_seat_limit():
    s = _sched(budget=256, max_seqs=3)
    for i, n in enumerate([600, 100, 50, 30]):
        s.add(_req(i, n))
    out = s.schedule(now=1.0)
    assert out.num_tokens <= 256
    assert out.seqs[0].num_new == 256 and not out.seqs[0].samples   # a chunk, multiple of 64
    _advance(s, out)
    for _ in range(10):
        out = s.schedule(now=1.0)
        assert out.num_tokens <= 256 and len(s.running) <= 3
        for seq in out.seqs:
            if not seq.samples:
                assert seq.num_new % 64 == 0
        _advance(s, out)


def test_decode_tokens_share_steps_with_prefill_chunks():
    s = _sched(budget=128)
    s.add(_req(0, 20))
    _advance(s, s.schedule(now=0.0))
    s.add(_req(1, 500))
    out = s.schedule(now=0.0)
    kinds = {(seq.req.request_id, seq.num_new) for seq in out.seqs}
    assert ("r0", 1) in kinds and ("r1", 64) in kinds


def test_dynamic_batching_window_holds_then_releases():
    s = _sched(budget=256, wait_ms=50)
    s.add(_req(0, 20, t=1.000))
    out = s.schedule(now=1.010)
    assert out.empty and out.wake_at == pytest.approx(1.050)
    s.add(_req(1, 20, t=1.020))
    out = s.schedule(now=1.060)            # window expired: both admitted in one step
    assert [q.req.request_id for q in out.seqs] == ["r0", "r1"]


def test_window_releases_when_budget_is_full():
    s = _sched(budget=128, wait_ms=1000)
    s.add(_req(0, 200, t=0.0))
    assert not s.schedule(now=0.001).empty


def test_preemption_requeues_at_front_and_frees():
    s = _sched(num_pages=4, budget=256)
    a, b = _req(0, 30), _req(1, 30)
    s.add(a)
    s.add(b)
    _advance(s, s.schedule(now=0.0))
    assert s.cache.pages.num_free == 0
    for _ in range(3):                       # decode grows a: b must give way
        out = s.schedule(now=0.0)
        _advance(s, out)
        if out.preempted:
            break
    assert out.preempted == [b] and s.waiting[0] is b
    assert s.cache.block_table(b) == [] and b.num_computed_tokens == 0 and b.metrics.num_preemptions == 1


def test_a_finished_request_id_comes_back_with_a_fresh_holding():
    """The cache forgets what a finished request held: the same id with other tokens gets no hit
    from the first request's pages."""
    spec = cache_spec(CFG, 16)
    plan = plan_cache(spec, torch.float32, 10**7, 8, num_pages=64)
    s = Scheduler(CacheManager(spec, plan, torch.float32, prefix_caching=True), 8, 256, 64)
    first = Request("r", list(range(3, 43)), SamplingParams(max_tokens=8))
    s.add(first)
    out = s.schedule(now=0.0)
    s.update_from_output(out, [SeqResult() for _ in out.seqs])   # registers its 2 full pages
    s.remove(first)
    assert s.cache.block_table(first) == [] and s.cache.pages.num_used == 0

    again = Request("r", list(range(103, 143)), SamplingParams(max_tokens=8))
    s.add(again)
    s.schedule(now=0.0)
    assert again.num_computed_tokens == 0 and again.num_cached_tokens == 0
    same = Request("q", list(range(3, 43)), SamplingParams(max_tokens=8))   # the first one's tokens do hit
    s.add(same)
    s.schedule(now=0.0)
    assert same.num_computed_tokens == 32 and same.num_cached_tokens == 32
