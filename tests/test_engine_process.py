"""A server whose engine runs in an engine process (what `flashlane serve` runs and LiveServer
starts by default): the engine args reach the child, it serves the in-process engine's outputs,
a storm of clients loses nothing, and a killed engine process turns into 503s and an unhealthy
/health instead of a hang. Load errors are raised in the parent."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time

import httpx
import pytest
import torch

from flashlane import LLM, SamplingParams
from flashlane.engine.errors import EngineDeadError
from flashlane.engine.launch import engine_in_process
from flashlane.engine.process_transport import ProcessTransport
from flashlane.models.registry import load_model

from engine_models import preset
from server_harness import ENGINE_ARGS, LiveServer, metric

MODEL = "tiny-flash"
PROMPTS = [[5, 6, 7, 8, 9], [11, 12, 13], list(range(20, 60))]
MAX_NUM_SEQS = 8     # not the default: the child must have been told


@pytest.fixture(scope="module")
def server():
    with LiveServer(preset(MODEL), MODEL, max_num_seqs=MAX_NUM_SEQS) as srv:
        yield srv


def _collect(engine, rid: str, prompt, params) -> list:
    async def run():
        return [out async for out in engine.generate(rid, prompt, params)]
    return asyncio.run(run())


def test_a_preset_loads_the_same_weights_every_time():
    # what lets the engine process load a preset for a test that holds it loaded already
    again = load_model(MODEL, dtype="float32")
    held = preset(MODEL).model.state_dict()
    fresh = again.model.state_dict()
    assert held.keys() == fresh.keys()
    assert all(torch.equal(held[k], fresh[k]) for k in held)


def test_the_engine_args_reach_the_engine_process(server):
    assert isinstance(server.engine.transport, ProcessTransport) and server.engine.transport.pid != os.getpid()
    models = httpx.get(server.url + "/v1/models").json()["data"][0]
    assert models["max_model_len"] == ENGINE_ARGS["max_model_len"]
    assert models["flashlane"]["max_running"] == MAX_NUM_SEQS == server.engine.info.max_running
    assert models["flashlane"]["dtype"] == "float32"


def test_greedy_outputs_equal_the_in_process_engine(server):
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    ref = LLM(preset(MODEL), **ENGINE_ARGS, max_num_seqs=MAX_NUM_SEQS).generate(PROMPTS, params)
    with server.client() as c:
        for i, (prompt, want) in enumerate(zip(PROMPTS, ref)):
            r = c.post("/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 12,
                                                "temperature": 0, "ignore_eos": True})
            assert r.status_code == 200, r.text
            assert r.json()["choices"][0]["text"] == want.text
            assert r.json()["usage"]["completion_tokens"] == 12


def test_engine_errors_come_back_as_the_same_400s(server):
    with server.client() as c:
        r = c.post("/v1/completions", json={"model": MODEL, "prompt": [1] * 600, "max_tokens": 2})
        assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
        assert r.json()["error"]["param"] == "prompt"
    steps = httpx.get(server.url + "/debug/steps", params={"limit": 2}).json()
    assert steps["total"] > 0 and len(steps["steps"]) <= 2


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
    with LiveServer(preset(MODEL), MODEL) as srv, httpx.Client(base_url=srv.url, timeout=60) as c:
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
                            os.kill(srv.engine.transport.pid, signal.SIGKILL)
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
        engine_in_process(preset(MODEL), **ENGINE_ARGS)
    with pytest.raises(ValueError, match="max_num_batched_tokens"):   # raised in the child, as it raised it
        engine_in_process(MODEL, **{**ENGINE_ARGS, "num_threads": 1, "max_num_batched_tokens": 0})
    with pytest.raises(TypeError, match="unknown engine argument"):
        engine_in_process(MODEL, **ENGINE_ARGS, not_an_arg=1)
