"""The server under load and abuse (real HTTP, tiny-flash): 64 concurrent streams, clients that
vanish mid-request, queue overflow, shutdown with requests in flight."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time

import httpx
import openai
import pytest

from flashlane import LLM, SamplingParams

from engine_models import preset
from server_harness import ENGINE_ARGS, LiveServer, metric

MODEL = "tiny-flash"
LONG = {"max_tokens": 400, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def loaded():
    return preset(MODEL)


@pytest.fixture(scope="module")
def server(loaded):
    with LiveServer(loaded, MODEL, transport="thread") as srv:   # tests read the engine's step stats
        yield srv


def _ok(server) -> None:
    r = httpx.post(server.url + "/v1/completions", headers=server.headers, timeout=120,
                   json={"model": MODEL, "prompt": "still alive", "max_tokens": 2, "temperature": 0})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] >= 1
    assert httpx.get(server.url + "/health").status_code == 200


@pytest.mark.slow
def test_64_concurrent_streams_match_llm_generate(server, loaded):
    prompts = [f"Request number {i} says" for i in range(64)]
    ref = LLM(loaded, **ENGINE_ARGS).generate(prompts, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=600)

    async def one(i: int) -> tuple[str, str | None, int]:
        stream = await client.completions.create(model=MODEL, prompt=prompts[i], max_tokens=8, temperature=0,
                                                 stream=True, stream_options={"include_usage": True},
                                                 extra_body={"ignore_eos": True})
        text, reason, used = "", None, 0
        async for chunk in stream:
            if chunk.choices:
                text += chunk.choices[0].text
                reason = chunk.choices[0].finish_reason or reason
            if chunk.usage:
                used = chunk.usage.completion_tokens
        return text, reason, used

    async def all_of_them():
        try:
            return await asyncio.gather(*(one(i) for i in range(64)))
        finally:
            await client.close()

    results = asyncio.run(all_of_them())
    assert [r[0] for r in results] == [o.text for o in ref]
    assert all(r[1] == "length" and r[2] == 8 for r in results)
    steps = server.engine.transport.engine.step_stats
    assert max(s.num_seqs for s in steps) > 8  # they really shared steps
    server.wait_idle()


def _stream_then_close(server, body: dict, chunks: int) -> None:
    """Open an SSE stream, read ``chunks`` content events, then drop the connection."""
    with httpx.Client(timeout=120, headers=server.headers) as c:
        with c.stream("POST", server.url + "/v1/chat/completions", json={**body, "stream": True}) as r:
            assert r.status_code == 200
            seen = 0
            for line in r.iter_lines():
                if line.startswith("data: {") and '"content":""' not in line:
                    seen += 1
                    if seen >= chunks:
                        break


def _raw_post(port: int, path: str, body: dict) -> socket.socket:
    data = json.dumps(body).encode()
    s = socket.create_connection(("127.0.0.1", port))
    s.sendall(b"POST " + path.encode() + b" HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
              b"Content-Length: " + str(len(data)).encode() + b"\r\n\r\n" + data)
    return s


def test_clients_closing_mid_request_free_everything(server):
    before = server.metrics()
    aborted0 = metric(before, "flashlane:request_success_total", finished_reason="abort")
    body = {"model": MODEL, "messages": [{"role": "user", "content": "tell me a long story"}], **LONG}
    threads = [threading.Thread(target=_stream_then_close, args=(server, body, k)) for k in (1, 2, 3, 5)]
    for t in threads:
        t.start()
    # two non-streaming clients that hang up while their requests run
    socks = [_raw_post(server.port, "/v1/completions", {"model": MODEL, "prompt": f"tale {i}", **LONG})
             for i in range(2)]
    for t in threads:
        t.join(120)
    # Hang up only once the two posts are really running: the four streams' aborts are counted
    # and two requests still run, which can only be these (on a busy machine the posts may not
    # even have been read yet when the streams are done).
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        m = server.metrics()
        if (metric(m, "flashlane:request_success_total", finished_reason="abort") - aborted0 >= 4
                and metric(m, "flashlane:num_requests_running") >= 2):
            break
        time.sleep(0.05)
    for s in socks:
        s.close()
    after = server.wait_idle(timeout=30)
    assert metric(after, "flashlane:request_success_total", finished_reason="abort") - aborted0 == 6
    assert metric(after, "flashlane:cache_pages_used") == 0
    assert metric(after, "flashlane:state_slots_used") == 0
    assert server.app.state.ctx.admission.in_flight == 0
    assert not server.engine.transport.engine.requests
    _ok(server)


def test_queue_overflow_is_429_then_recovers(loaded):
    # two running + one queued sequence allowed; a fourth is refused
    with LiveServer(loaded, MODEL, max_queue=1, max_num_seqs=2) as srv:
        body = {"model": MODEL, "prompt": "hold the line", **LONG}
        holders = []
        for _ in range(3):
            c = httpx.Client(timeout=120)
            r = c.send(c.build_request("POST", srv.url + "/v1/completions", json={**body, "stream": True}), stream=True)
            assert r.status_code == 200
            holders.append((c, r))
        r = httpx.post(srv.url + "/v1/completions", json={**body, "max_tokens": 2}, timeout=60)
        assert r.status_code == 429, r.text
        assert r.headers["retry-after"] == "1"
        assert r.json()["error"]["type"] == "rate_limit_error"
        oc = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0)
        with pytest.raises(openai.RateLimitError):
            oc.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2)
        with pytest.raises(openai.BadRequestError):  # can never fit, whatever the load
            oc.completions.create(model=MODEL, prompt="x", n=4, max_tokens=2)
        # a 200 comes back when the stream opens, maybe before the engine has scheduled it
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            m = srv.metrics()
            if metric(m, "flashlane:num_requests_running") + metric(m, "flashlane:num_requests_waiting") == 3:
                break
            time.sleep(0.05)
        assert metric(m, "flashlane:num_requests_running") == 2
        assert metric(m, "flashlane:num_requests_waiting") == 1
        assert metric(m, "flashlane:http_requests_total", status="429") == 2
        for c, r in holders:
            r.close()
            c.close()
        srv.wait_idle()
        _ok(srv)


def _open_stream(url: str, body: dict):
    c = httpx.Client(timeout=120)
    r = c.send(c.build_request("POST", url + "/v1/completions", json={**body, "stream": True}), stream=True)
    assert r.status_code == 200
    return c, r


def _drain(r) -> list[str]:
    lines = []
    try:
        for line in r.iter_lines():
            if line:
                lines.append(line)
    except httpx.HTTPError:
        pass  # the server cut the connection
    return lines


def test_shutdown_drains_short_requests_and_fails_long_ones(loaded):
    srv = LiveServer(loaded, MODEL, graceful_s=3.0, transport="thread")
    real_run = srv.engine.transport.engine.runner.run

    def paced_run(sched):
        # >= 20 ms a step on any machine: the long request's 400 steps (>= 8 s) cannot finish in
        # the 3 s grace period however fast the CPU, the short one's few steps easily do
        time.sleep(0.02)
        return real_run(sched)

    srv.engine.transport.engine.runner.run = paced_run
    with srv:
        c1, short = _open_stream(srv.url, {"model": MODEL, "prompt": "quick one", "max_tokens": 4,
                                           "temperature": 0, "ignore_eos": True})
        c2, long = _open_stream(srv.url, {"model": MODEL, "prompt": "never finishes", **LONG})
        stopper = threading.Thread(target=srv.stop)
        t0 = time.monotonic()
        stopper.start()
        short_lines, long_lines = _drain(short), _drain(long)
        stopper.join(60)
        assert time.monotonic() - t0 < 30
        assert not srv.thread.is_alive()
        for c in (c1, c2):
            c.close()
    assert short_lines[-1] == "data: [DONE]"  # drained: finished within the graceful period
    # aborted when the period ran out: an error event, then [DONE] (issue 21)
    assert long_lines[-1] == "data: [DONE]"
    assert json.loads(long_lines[-2][len("data: "):])["error"]["code"] == "service_unavailable"
    assert not srv.engine.alive
    assert not srv.engine.transport.engine.requests
    usage = srv.engine.transport.engine.cache.usage()
    assert usage["pages_used"] == 0 and usage["slots_used"] == 0


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")  # the engine thread dies
def test_engine_failure_is_503_not_a_hang(loaded):
    with LiveServer(loaded, MODEL, transport="thread") as srv:
        real_run = srv.engine.transport.engine.runner.run
        calls = {"n": 0}

        def failing_run(sched):
            calls["n"] += 1
            if calls["n"] > 3:
                raise RuntimeError("injected step failure")
            return real_run(sched)

        srv.engine.transport.engine.runner.run = failing_run
        with httpx.Client(timeout=60) as c:
            with c.stream("POST", srv.url + "/v1/completions",
                          json={"model": MODEL, "prompt": "doomed", "stream": True, **LONG}) as r:
                assert r.status_code == 200
                events = [line for line in r.iter_lines() if line.startswith("data: ")]
            assert events[-1] == "data: [DONE]"
            err = json.loads(events[-2][6:])["error"]
            assert err["code"] == "service_unavailable" and "injected" in err["message"]
            r = c.post(srv.url + "/v1/completions", json={"model": MODEL, "prompt": "after", "max_tokens": 2})
            assert r.status_code == 503 and r.json()["error"]["type"] == "server_error"
            health = c.get(srv.url + "/health")
            assert health.status_code == 503 and "injected" in health.json()["error"]
            assert c.get(srv.url + "/metrics").status_code == 200
