"""The engine-core process (EngineCoreClient): same outputs as the in-process engine, a storm of
clients loses nothing, and a killed engine process turns into 503s and an unhealthy /health
instead of a hang."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time

import httpx
import pytest

from flashlane import LLM, SamplingParams
from flashlane.engine.async_engine import EngineDeadError
from flashlane.engine.core_client import EngineCoreClient

from engine_models import preset
from server_harness import ENGINE_ARGS, LiveServer, metric

MODEL = "tiny-flash"
CORE_ARGS = {**ENGINE_ARGS, "num_threads": 1}   # the child sets its own torch threads
PROMPTS = [[5, 6, 7, 8, 9], [11, 12, 13], list(range(20, 60))]


def _core() -> EngineCoreClient:
    return EngineCoreClient(MODEL, **CORE_ARGS)


@pytest.fixture(scope="module")
def server():
    with LiveServer(None, MODEL, engine=_core()) as srv:
        yield srv


def _collect(engine, rid: str, prompt, params) -> list:
    async def run():
        return [out async for out in engine.generate(rid, prompt, params)]
    return asyncio.run(run())


def test_greedy_outputs_equal_the_in_process_engine(server):
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    ref = LLM(preset(MODEL), **ENGINE_ARGS).generate(PROMPTS, params)
    with server.client() as c:
        for i, (prompt, want) in enumerate(zip(PROMPTS, ref)):
            r = c.post("/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 12,
                                                "temperature": 0, "ignore_eos": True})
            assert r.status_code == 200, r.text
            assert r.json()["choices"][0]["text"] == want.text
            assert r.json()["usage"]["completion_tokens"] == 12
    outs = _collect(server.engine, "direct", PROMPTS[0], params)   # the client itself, outside HTTP
    assert outs[-1].token_ids == ref[0].token_ids and outs[-1].finished
    assert "".join(o.delta_text for o in outs) == ref[0].text


def test_engine_errors_come_back_as_the_same_400s(server):
    with server.client() as c:
        r = c.post("/v1/completions", json={"model": MODEL, "prompt": [1] * 600, "max_tokens": 2})
        assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
    with pytest.raises(ValueError, match="maximum context"):   # the engine's own check, raised in the child
        _collect(server.engine, "too-long", [1] * 600, SamplingParams(max_tokens=2))
    models = httpx.get(server.url + "/v1/models").json()["data"][0]
    assert models["max_model_len"] == 512 and models["flashlane"]["max_running"] == server.engine.info.max_running
    steps = httpx.get(server.url + "/debug/steps", params={"limit": 2}).json()
    assert steps["total"] > 0 and len(steps["steps"]) <= 2


def test_a_profiling_window_is_taken_in_the_engine_process(server, tmp_path):
    asyncio.run(server.engine.start_profile())
    _collect(server.engine, "profiled", PROMPTS[1], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    written = asyncio.run(server.engine.stop_profile(str(tmp_path)))
    assert written["steps"] >= 4 and os.path.exists(written["trace"]) and os.path.exists(written["summary"])
    with pytest.raises(RuntimeError, match="no profiling window"):   # the child's error, raised here
        asyncio.run(server.engine.stop_profile(str(tmp_path)))


def test_a_storm_of_clients_loses_nothing(server):
    n, leave = 32, range(0, 32, 4)      # every 4th client disconnects after its first event

    async def one(client: httpx.AsyncClient, i: int) -> tuple[str, int]:
        body = {"model": MODEL, "prompt": f"storm client {i}", "max_tokens": 16, "temperature": 0,
                "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
        async with client.stream("POST", "/v1/completions", json=body) as r:
            assert r.status_code == 200
            reason, used = None, 0
            async for line in r.aiter_lines():
                if not line.startswith("data: {"):
                    continue
                if i in leave:
                    return "left", 0
                event = json.loads(line[6:])
                if event["choices"]:
                    reason = event["choices"][0]["finish_reason"] or reason
                if event.get("usage"):
                    used = event["usage"]["completion_tokens"]
            return reason, used

    async def storm():
        async with httpx.AsyncClient(base_url=server.url, timeout=300) as client:
            return await asyncio.gather(*(one(client, i) for i in range(n)))

    results = asyncio.run(storm())
    assert [r for i, r in enumerate(results) if i not in leave] == [("length", 16)] * (n - len(leave))
    idle = server.wait_idle()   # the ones that left were aborted: nothing held, nothing queued
    assert metric(idle, "flashlane:request_success_total", finished_reason="abort") >= 1
    assert httpx.get(server.url + "/health").status_code == 200


def _wait(predicate, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.02)


def test_a_killed_engine_process_gives_503s_and_an_unhealthy_health():
    long = {"model": MODEL, "max_tokens": 500, "temperature": 0, "ignore_eos": True}
    with LiveServer(None, MODEL, engine=_core()) as srv, httpx.Client(base_url=srv.url, timeout=60) as c:
        assert c.get("/health").status_code == 200

        async def in_flight():
            async with httpx.AsyncClient(base_url=srv.url, timeout=60) as ac:
                blocking = asyncio.create_task(ac.post("/v1/completions", json={**long, "prompt": "waits"}))
                async with ac.stream("POST", "/v1/completions", json={**long, "prompt": "streams",
                                                                      "stream": True}) as r:
                    events = []
                    async for line in r.aiter_lines():
                        if not line.startswith("data: "):
                            continue
                        events.append(line)
                        if len(events) == 1:   # both requests are in the engine: kill it
                            await asyncio.to_thread(_wait, lambda: srv.gauge("flashlane:num_requests_running") == 2)
                            os.kill(srv.engine.pid, signal.SIGKILL)
                return events, await blocking

        events, blocked = asyncio.run(in_flight())
        assert events[-1] == "data: [DONE]"
        err = json.loads(events[-2][6:])["error"]
        assert err["code"] == "service_unavailable" and "engine process exited" in err["message"]
        assert blocked.status_code == 503, blocked.text
        _wait(lambda: c.get("/health").status_code == 503, timeout=10)
        assert "engine process exited" in c.get("/health").json()["error"]
        r = c.post("/v1/completions", json={**long, "prompt": "after", "max_tokens": 2})
        assert r.status_code == 503 and r.json()["error"]["type"] == "server_error"
        assert c.get("/metrics").status_code == 200   # the last numbers, no hang
    with pytest.raises(EngineDeadError):
        _collect(srv.engine, "late", [1, 2], SamplingParams(max_tokens=2))


def test_load_errors_are_raised_in_the_parent():
    with pytest.raises(TypeError, match="loads the model itself"):
        EngineCoreClient(preset(MODEL), **CORE_ARGS)
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        EngineCoreClient(MODEL, **{**CORE_ARGS, "max_num_batched_tokens": 1})


def _fields(out) -> dict:
    m = out.metrics
    return {**{k: v for k, v in vars(out).items() if k != "metrics"},
            "metrics": (m.arrival_time, m.first_scheduled_time, m.first_token_time, list(m.token_times),
                        m.finish_time, m.num_preemptions)}


def test_output_deltas_rebuild_every_cumulative_output():
    import pickle

    from flashlane.engine.llm_engine import LLMEngine
    from flashlane.engine.output_deltas import DeltaDecoder, DeltaEncoder

    engine = LLMEngine(preset(MODEL), **ENGINE_ARGS)
    engine.add_request("lp", [5, 6, 7, 8], SamplingParams(max_tokens=6, temperature=0, logprobs=2, prompt_logprobs=1))
    engine.add_request("one", [9, 10], SamplingParams(max_tokens=1, temperature=0))
    engine.add_request("cut", [11, 12, 13], SamplingParams(max_tokens=50, temperature=0, ignore_eos=True))
    encoder, decoder, seen = DeltaEncoder(), DeltaDecoder(), 0
    while engine.has_unfinished():
        outs = engine.step()
        if seen >= 4 and "cut" in engine.requests:
            outs.append(engine.abort("cut"))
        for out in outs:
            rebuilt = decoder.decode(pickle.loads(pickle.dumps(encoder.encode(out))))
            assert _fields(rebuilt) == _fields(out)
            seen += 1
    assert not encoder._sent and not decoder._streams   # nothing kept for finished requests
