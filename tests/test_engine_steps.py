"""Engine step records: what a step records, the ring buffer, `GET /debug/steps`, and the bench's
idle-gap classes and busy fraction computed from them."""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

import httpx
import pytest

from flashlane import LLM, SamplingParams
from flashlane.bench.idle_gaps import step_busy_fractions, step_gaps, summarize_gaps
from flashlane.bench.runner import BenchConfig, analyse_telemetry
from flashlane.bench.telemetry import Telemetry
from flashlane.engine.step_log import StepLog, StepRecord

from engine_models import preset, random_prompts
from server_harness import LiveServer


def _rec(i: int, start: float, end: float, waiting: int = 0) -> StepRecord:
    return StepRecord(step=i, start=start, end=end, start_monotonic=start, model_s=end - start,
                      sample_s=0.0, num_seqs=1,
                      num_tokens=1, prefill_tokens=0, decode_tokens=1, decode_seqs=1, num_running=1,
                      num_waiting=waiting, num_preempted=0, pages_used=1, slots_used=1, request_ids=("r",))


# ---- pure functions on a synthetic timeline -------------------------------------------------------
def test_step_gaps_classify_a_b_c_on_the_engine_clock():
    # window 0..10; steps (start, end, waiting after)
    steps = [(-1.0, 0.5, 0), (1.5, 2.0, 0), (2.05, 3.0, 3), (4.0, 4.5, 0), (4.6, 9.0, 0)]
    in_flight = [(1.2, 3.1), (3.5, 4.4), (9.5, 9.8)]
    gaps = step_gaps(steps, in_flight, 0.0, 10.0, min_gap_s=0.2)
    spans = [(g["start"], g["end"]) for g in gaps]
    # 0.5-1.5 (window start inside a step before it), 3.0-4.0, 9.0-10.0 (to the window end);
    # 2.0-2.05 and 4.5-4.6 are shorter than min_gap_s
    assert spans == [(0.5, 1.5), (3.0, 4.0), (9.0, 10.0)]
    a, c, tail = gaps
    # nothing in flight until 1.2, then in flight with nothing queued: mostly A, 0.3 s of B
    assert a["cls"] == "A" and a["a_s"] == pytest.approx(0.7) and a["b_s"] == pytest.approx(0.3)
    # the step before it left 3 waiting: in-flight time is queue (C), the rest workload idle
    assert c["cls"] == "C" and c["c_s"] == pytest.approx(0.6) and c["a_s"] == pytest.approx(0.4)
    assert tail["cls"] == "A" and tail["b_s"] == pytest.approx(0.3)
    s = summarize_gaps(gaps, window_s=10.0)
    assert s["by_class"]["C"]["count"] == 1 and s["idle_fraction"] == pytest.approx(0.3)


def test_step_busy_fractions_clip_to_the_window():
    steps = [(-1.0, 1.0, 0), (2.0, 3.0, 0), (9.0, 12.0, 0)]
    bf = step_busy_fractions(steps, [(0.5, 2.5)], 0.0, 10.0)
    assert bf["overall"] == pytest.approx(0.3)             # 1 + 1 + 1 of 10 s
    assert bf["when_in_flight"] == pytest.approx(0.5)      # 0.5-1.0 and 2.0-2.5 of 2 s in flight
    assert step_busy_fractions([], [], 0.0, 10.0)["when_in_flight"] is None


def test_step_log_is_a_ring_buffer_read_since_a_time():
    log = StepLog(maxlen=3)
    for i in range(5):
        log.append(_rec(i + 1, 10.0 + i, 10.5 + i))
    assert len(log) == 3 and log.total == 5 and log.oldest().step == 3
    assert [r.step for r in log.since(12.5)] == [4, 5]     # ends after 12.5: 13.5, 14.5 (12.5 excluded)
    assert [r.step for r in log.since(None, limit=2)] == [3, 4]
    assert "request_ids" not in log.since()[0].to_json(with_ids=False)
    log.clear()
    assert not log and log.total == 0


def test_analyse_telemetry_prefers_engine_steps():
    tel = Telemetry("http://127.0.0.1:9", use_nvml=False)
    tel.engine_steps = [{"start": 1.0, "end": 2.0, "num_waiting": 0}, {"start": 5.0, "end": 6.0, "num_waiting": 0}]
    records = [SimpleNamespace(send_time=0.6, end_time=6.0)]
    cfg = BenchConfig("http://x", "/tmp/unused", concurrency=[1])
    out, gaps, series = analyse_telemetry(tel, records, 0.0, 10.0, cfg)
    assert out["utilisation_source"] == "engine.steps" and "engine step records" in out["idle_gap_source"]
    assert out["busy_overall"] == pytest.approx(0.2)
    assert [g["cls"] for g in gaps] == ["A", "B", "A"]     # 0-1 (0.4 in flight), 2-5 bubble, 6-10 idle
    assert out["idle_gaps"]["by_class"]["B"]["total_s"] == pytest.approx(3.0)
    assert series["util"][0]


# ---- what the engine records --------------------------------------------------------------------
def test_engine_records_every_step():
    m = preset("tiny-flash")
    prompts = random_prompts(5, 30, 150, 4000, seed=21)
    llm = LLM(m, dtype="float32", max_num_batched_tokens=128, enable_prefix_caching=False, step_log_size=1000)
    before = time.time()
    outs = llm.generate(prompts, SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))
    steps = list(llm.engine.step_stats)
    assert [s.step for s in steps] == list(range(1, len(steps) + 1))
    assert before <= steps[0].start and all(a.end <= b.start for a, b in zip(steps, steps[1:]))
    assert all(0 < s.model_s <= s.end - s.start for s in steps)
    assert all(0 < s.sample_s < s.model_s for s in steps)  # sampling is timed inside the model run
    assert sum(s.prefill_tokens for s in steps) == sum(len(p) for p in prompts)
    assert sum(s.decode_tokens for s in steps) == sum(len(o.token_ids) - 1 for o in outs)
    assert all(s.num_tokens == s.prefill_tokens + s.decode_tokens and s.num_seqs == len(s.request_ids)
               for s in steps)
    assert steps[0].num_waiting > 0 and steps[-1].num_waiting == 0 and steps[-1].num_running == 0
    assert {r for s in steps for r in s.request_ids} == {o.request_id for o in outs}


# ---- over HTTP ----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def server():
    with LiveServer(preset("tiny-flash"), "tiny-flash", api_key="k3y") as srv:
        yield srv


def test_debug_steps_over_http(server):
    with server.client() as c:
        t0 = time.time()
        r = c.post("/v1/completions", json={"model": "tiny-flash", "prompt": [5, 6, 7, 8], "max_tokens": 4,
                                            "temperature": 0})
        assert r.status_code == 200
        doc = c.get("/debug/steps", params={"since": t0, "request_ids": True}).json()
        assert doc["clock"].startswith("time.time()") and doc["dropped"] == 0 and not doc["more"]
        steps = doc["steps"]
        assert len(steps) == 4 and all(t0 <= s["start"] <= s["end"] <= doc["now"] for s in steps)
        assert steps[0]["prefill_tokens"] == 4 and all(s["decode_tokens"] == 1 for s in steps[1:])
        assert len({s["request_ids"][0] for s in steps}) == 1
        paged = c.get("/debug/steps", params={"since": t0, "limit": 3}).json()
        assert paged["more"] and len(paged["steps"]) == 3 and "request_ids" not in paged["steps"][0]
        assert c.get("/debug/steps", params={"since": steps[-1]["end"]}).json()["steps"] == []
        assert c.get("/debug/steps", params={"limit": 0}).status_code in (400, 422)
    assert httpx.get(server.url + "/debug/steps", timeout=30).status_code == 401   # same auth as the API


def test_telemetry_fetches_steps_onto_the_bench_clock(server):
    from flashlane.bench.clock import now

    async def go():
        tel = Telemetry(server.url, use_nvml=False)
        since = now()
        with server.client() as c:
            c.post("/v1/completions", json={"model": "tiny-flash", "prompt": [9, 8, 7], "max_tokens": 3})
        until = now()
        async with httpx.AsyncClient(timeout=30, headers=server.headers) as client:
            await tel.fetch_engine_steps(client, since)
        return tel, since, until

    tel, since, until = asyncio.run(go())
    assert len(tel.engine_steps) == 3 and tel.engine_steps_complete
    assert all(since <= s["start"] <= s["end"] <= until for s in tel.engine_steps)


def test_telemetry_keeps_cpu_path_without_the_endpoint(fake_server):
    async def go():
        tel = Telemetry(fake_server.url, use_nvml=False)
        async with httpx.AsyncClient(timeout=30) as client:
            await tel.fetch_engine_steps(client, 0.0)
        return tel

    assert asyncio.run(go()).engine_steps is None
