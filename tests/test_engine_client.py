"""EngineClient over both transports (the engine on a thread of this process, or in an engine
process of its own): the offline LLM's outputs for every output kind, a stop string found here
ends the engine request as a stop, however a consumer leaves its requests are aborted, the
engine's refusals arrive as it raised them, stats, step pages and profiling windows, and a dead
engine fails what is in flight and everything after it instead of hanging."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import signal
import threading
import time
from contextlib import aclosing

import pytest

from flashlane import LLM, SamplingParams
from flashlane.engine.client import EngineClient
from flashlane.engine.errors import EngineDeadError
from flashlane.engine.messages import AddRequests, Call
from flashlane.engine.request_check import InvalidRequest
from flashlane.engine.sampling_params import OutputKind
from flashlane.trace_ranges import profiling_enabled

from engine_models import preset
from server_harness import ENGINE_ARGS, start_engine

MODEL = "tiny-flash"
TRANSPORTS = ["thread", "process"]
GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
LONG = SamplingParams(max_tokens=400, temperature=0, ignore_eos=True)
PROMPTS = ["The quick brown fox", [5, 6, 7, 8, 9], list(range(20, 60))]


def _start(transport: str, **engine_args) -> EngineClient:
    client = start_engine(preset(MODEL), transport, **engine_args)
    client.start()
    return client


@pytest.fixture(scope="module", params=TRANSPORTS)
def client(request):
    c = _start(request.param)
    yield c
    c.shutdown()


@pytest.fixture(scope="module")
def llm():
    return LLM(preset(MODEL), **ENGINE_ARGS)


def _collect(client: EngineClient, rid: str, prompt, params: SamplingParams) -> list:
    async def run():
        return [out async for out in client.generate(rid, prompt, params)]
    return asyncio.run(run())


def _snapshot(client: EngineClient) -> dict:
    return asyncio.run(client.stats_snapshot(timeout=60))


def _until(client: EngineClient, what: str, predicate, timeout: float = 60.0) -> dict:
    """Take snapshots until ``predicate(snapshot)`` holds (an abort the client sent reaches the
    engine after the outputs the caller already has); the snapshot that satisfied it."""
    deadline = time.monotonic() + timeout
    while not predicate(snap := _snapshot(client)):
        assert time.monotonic() < deadline, f"gave up waiting for {what}: {snap}"
        time.sleep(0.02)
    return snap


def _count(snap: dict, reason: str) -> int:
    return snap["finish_reasons"].get(reason, 0)


def _idle(snap: dict) -> bool:
    return snap["running"] == snap["waiting"] == snap["pages_used"] == 0


async def _drain(outs) -> None:
    async for _ in outs:
        pass


async def _within(outs, timeout: float):
    """``outs``, failing instead of waiting forever for an output that never comes."""
    while True:
        try:
            yield await asyncio.wait_for(outs.__anext__(), timeout)
        except StopAsyncIteration:
            return


# ---- outputs ---------------------------------------------------------------------------------
def test_every_output_kind_gives_the_offline_llms_outputs(client, llm):
    ref = llm.generate(PROMPTS, GREEDY)

    async def run(kind: OutputKind) -> list[list]:
        params = dataclasses.replace(GREEDY, output_kind=kind)
        got = [[] for _ in PROMPTS]
        async for i, out in client.generate_many([(f"{kind.name}-{i}", p, params) for i, p in enumerate(PROMPTS)]):
            got[i].append(out)
        return got

    assert all(len(want.token_ids) == GREEDY.max_tokens and want.text for want in ref)
    final, cumulative, delta = (asyncio.run(run(kind)) for kind in
                                (OutputKind.FINAL_ONLY, OutputKind.CUMULATIVE, OutputKind.DELTA))
    for prompt, want, f, c, d in zip(PROMPTS, ref, final, cumulative, delta):
        assert len(f) == 1 and f[0].finished and f[0].finish_reason == "length"
        assert (f[0].token_ids, f[0].text) == (want.token_ids, want.text)
        assert f[0].prompt_token_ids == want.prompt_token_ids
        assert f[0].prompt == (prompt if isinstance(prompt, str) else None)

        assert [o.finished for o in c] == [False] * (len(c) - 1) + [True]
        assert (c[-1].token_ids, c[-1].text) == (want.token_ids, want.text)
        assert all(o.num_output_tokens == len(o.token_ids) for o in c)
        assert all(b.token_ids[:len(a.token_ids)] == a.token_ids and b.text.startswith(a.text)
                   for a, b in zip(c, c[1:]))

        assert "".join(o.text for o in d) == want.text
        assert [t for o in d for t in o.token_ids] == want.token_ids
        assert [o.num_output_tokens for o in d] == [len(o.token_ids) for o in c]
        m = d[-1].metrics
        assert len(m.token_times) == GREEDY.max_tokens and m.first_token_time <= m.finish_time


def test_logprobs_come_once_per_token_and_prompt_logprobs_once(client, llm):
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logprobs=2, prompt_logprobs=1)
    want = llm.generate([PROMPTS[1]], params)[0]
    d = _collect(client, "lp", PROMPTS[1], dataclasses.replace(params, output_kind=OutputKind.DELTA))
    assert [lp for o in d for lp in o.logprobs] == want.logprobs
    assert d[0].prompt_logprobs == want.prompt_logprobs and all(o.prompt_logprobs is None for o in d[1:])
    f = _collect(client, "lp-final", PROMPTS[1], dataclasses.replace(params, output_kind=OutputKind.FINAL_ONLY))
    assert (f[0].logprobs, f[0].prompt_logprobs) == (want.logprobs, want.prompt_logprobs)


def test_a_stop_string_found_here_ends_the_engine_request_as_a_stop(client, llm):
    long = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    text = llm.generate([PROMPTS[0]], long)[0].text
    stop = text[len(text) // 3:len(text) // 3 + 3]
    cut = text.index(stop)
    before = _snapshot(client)
    outs = _collect(client, "stops", PROMPTS[0],
                    dataclasses.replace(long, stop=[stop], output_kind=OutputKind.DELTA))
    last = outs[-1]
    assert last.finish_reason == "stop" and last.stop_reason == stop
    assert "".join(o.text for o in outs) == text[:cut]
    assert last.num_output_tokens < long.max_tokens
    # the engine ends it when the client's abort arrives, counted as a stop, not an abort
    after = _until(client, "the stop to be counted", lambda s: _count(s, "stop") == _count(before, "stop") + 1)
    assert _count(after, "abort") == _count(before, "abort") and _idle(after)


# ---- consumers that leave, aborts --------------------------------------------------------------
def test_a_consumer_that_leaves_aborts_its_requests(client):
    before = _snapshot(client)

    async def leave_one():
        async with aclosing(client.generate("leaves", PROMPTS[1], LONG)) as outs:
            async for _ in outs:
                break

    async def leave_many():    # one finishes, then the consumer goes: the other two are aborted
        short = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)
        reqs = [("m-short", PROMPTS[1], short), ("m-long0", PROMPTS[0], LONG), ("m-long1", PROMPTS[2], LONG)]
        async with aclosing(client.generate_many(reqs)) as outs:
            async for i, out in outs:
                if out.finished:
                    return i

    asyncio.run(leave_one())
    assert asyncio.run(leave_many()) == 0
    after = _until(client, "three aborts", lambda s: _count(s, "abort") == _count(before, "abort") + 3)
    assert _count(after, "length") == _count(before, "length") + 1 and _idle(after)


def test_abort_all_gives_every_stream_its_last_output(client):
    async def run():
        streams = [client.generate(f"all-{i}", p, LONG) for i, p in enumerate(PROMPTS[:2])]
        for s in streams:
            await s.__anext__()
        await asyncio.wrap_future(client.abort_all())
        return [[out async for out in s] for s in streams]

    rests = asyncio.run(run())
    assert [rest[-1].finish_reason for rest in rests] == ["abort", "abort"]
    assert all(rest[-1].finished and rest[-1].num_output_tokens < LONG.max_tokens for rest in rests)
    assert _idle(_snapshot(client))


def test_abort_many_ends_requests_nobody_listens_to(client):
    before = _snapshot(client)

    async def run():
        outs = client.generate_many([("gone0", PROMPTS[0], LONG), ("gone1", PROMPTS[1], LONG)])
        await outs.__anext__()
        client.abort_many(["gone0", "gone1"])

    asyncio.run(run())
    after = _until(client, "two aborts", lambda s: _count(s, "abort") == _count(before, "abort") + 2)
    assert _idle(after)


# ---- the engine's refusals ------------------------------------------------------------------------
def test_the_engines_refusals_arrive_as_it_raised_them(client):
    with pytest.raises(InvalidRequest, match="maximum context length is 512") as e:
        _collect(client, "too-long", [1] * 600, GREEDY)
    assert (e.value.param, e.value.code) == ("prompt", "context_length_exceeded")
    with pytest.raises(InvalidRequest, match="outside the vocabulary") as e:
        _collect(client, "bad-id", [5, client.info.vocab_size], GREEDY)
    assert e.value.param == "prompt"
    # a batch with one refusal adds none: the id of the good one is free again at once
    with pytest.raises(InvalidRequest):
        asyncio.run(_drain(client.generate_many([("ok", PROMPTS[1], LONG), ("refused", [1] * 600, GREEDY)])))
    assert _idle(_snapshot(client))
    assert _collect(client, "ok", PROMPTS[1], GREEDY)[-1].finish_reason == "length"


def test_a_request_id_in_flight_is_refused_and_the_first_request_goes_on():
    client = _start("thread")   # the client's own bookkeeping: the same over either transport
    params = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)

    async def run():
        first = client.generate("twice", PROMPTS[1], params)
        await first.__anext__()
        with pytest.raises(InvalidRequest) as e:
            await _drain(client.generate("twice", PROMPTS[2], params))
        assert e.value.param == "request_id"
        rest = [out async for out in _within(first, 20)]
        assert rest[-1].finish_reason == "length" and rest[-1].num_output_tokens == 30

    try:
        asyncio.run(run())
    finally:
        client.shutdown()


# ---- engine state -------------------------------------------------------------------------------
def test_stats_snapshot_and_step_page(client):
    snap = _snapshot(client)
    assert snap["engine_state"] == "running" and snap["engine_restarts"] == 0
    assert {"running", "waiting", "pages_used", "pages_total", "preemptions", "finish_reasons"} <= set(snap)
    since = time.time()
    _collect(client, "paged", PROMPTS[1], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    page = asyncio.run(client.step_page(since, 100, True))
    assert [s["request_ids"] for s in page["steps"]] == [["paged"]] * 4 and not page["more"]
    assert page["steps"][0]["prefill_tokens"] == len(PROMPTS[1])
    assert "request_ids" not in asyncio.run(client.step_page(since, 1, False))["steps"][0]


def test_a_profiling_window_is_taken_where_the_engine_steps(client, tmp_path):
    asyncio.run(client.start_profile())
    with pytest.raises(RuntimeError, match="already open"):   # the engine's error, raised here
        asyncio.run(client.start_profile())
    _collect(client, "profiled", PROMPTS[1], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    written = asyncio.run(client.stop_profile(str(tmp_path)))
    assert written["steps"] >= 4 and os.path.exists(written["trace"]) and os.path.exists(written["summary"])
    assert not profiling_enabled()   # closed (on the thread transport the window was this process's)
    with pytest.raises(RuntimeError, match="no profiling window"):
        asyncio.run(client.stop_profile(str(tmp_path)))


# ---- a dead engine ------------------------------------------------------------------------------
def _crash(client: EngineClient, transport: str) -> str:
    """Kill the engine mid-request; what the death is reported as."""
    if transport == "thread":
        def boom():
            raise RuntimeError("boom in a step")
        client.transport.engine.step = boom
        return "boom in a step"
    os.kill(client.transport.pid, signal.SIGKILL)
    return "killed by SIGKILL"


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")  # the thread dies on purpose
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_dead_engine_fails_what_is_in_flight_and_everything_after(transport):
    client = _start(transport)
    sent = []
    try:
        last = _snapshot(client)

        async def doomed() -> tuple[list, BaseException]:
            got = []
            with pytest.raises(EngineDeadError) as e:
                async for out in client.generate("doomed", PROMPTS[1], LONG):
                    got.append(out)
                    if len(got) == 1:
                        why.append(_crash(client, transport))
            return got, e.value

        why: list[str] = []
        got, err = asyncio.run(doomed())
        assert why[0] in str(err) and not got[-1].finished
        assert not client.alive and client.state == "dead" and why[0] in repr(client.error)
        with pytest.raises(EngineDeadError):
            _collect(client, "late", PROMPTS[1], GREEDY)
        with pytest.raises(EngineDeadError):
            asyncio.run(client.step_page(None, 1, False))
        with pytest.raises(EngineDeadError):
            asyncio.run(client.start_profile())
        # the last numbers taken while it ran, without asking the dead engine
        assert _snapshot(client) == {**last, "engine_state": "dead"}
        client.abort("late")
        real_send = client.transport.send
        client.transport.send = lambda msg: sent.append(msg) or real_send(msg)
    finally:
        client.shutdown(timeout=30)
    assert sent == []   # nothing waited on an engine that cannot answer
    assert not client.alive


# ---- a request given up while its add is on its way (these hold the engine's thread, so they
# need the engine in this process) ---------------------------------------------------------------
def _watch_adds(client: EngineClient) -> threading.Event:
    """Set once the client sends an add."""
    added = threading.Event()
    real_send = client.transport.send

    def send(msg):
        if isinstance(msg, Call) and isinstance(msg.command, AddRequests):
            added.set()
        real_send(msg)

    client.transport.send = send
    return added


async def _wait_event(event: threading.Event, timeout: float = 30.0) -> None:
    assert await asyncio.to_thread(event.wait, timeout)


def test_cancel_while_the_add_waits_behind_a_busy_engine_leaves_nothing():
    client = _start("thread")
    engine = client.transport.engine
    busy, gate = threading.Event(), threading.Event()
    real_snapshot = engine.snapshot

    def held_snapshot():
        busy.set()
        gate.wait(30)
        return real_snapshot()

    try:
        added = _watch_adds(client)

        async def scenario():
            engine.snapshot = held_snapshot
            held = asyncio.ensure_future(client.stats_snapshot(timeout=60))   # the engine thread waits in it
            await _wait_event(busy)
            engine.snapshot = real_snapshot
            task = asyncio.ensure_future(_drain(client.generate("queued", PROMPTS[1], LONG)))
            await _wait_event(added)
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            gate.set()
            await held
            # messages run in order: the add, then the abort the cancelled caller sent
            return await client.stats_snapshot(timeout=60)

        snap = asyncio.run(scenario())
        assert client.alive, client.error
        assert _idle(snap) and _count(snap, "abort") == 1 and not engine.requests
    finally:
        gate.set()
        client.shutdown()


def test_cancel_while_the_add_runs_aborts_the_request():
    client = _start("thread")
    engine = client.transport.engine
    real_add = engine.add_request
    started, release = threading.Event(), threading.Event()

    def slow_add(*args):
        started.set()
        release.wait(30)
        return real_add(*args)

    engine.add_request = slow_add
    try:
        async def scenario():
            task = asyncio.ensure_future(_drain(client.generate("running", PROMPTS[1], LONG)))
            await _wait_event(started)
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            release.set()

        asyncio.run(scenario())
        snap = _until(client, "the abort", lambda s: _count(s, "abort") == 1)   # the add completes, then the abort
        assert client.alive and _idle(snap) and not engine.requests
    finally:
        release.set()
        client.shutdown()


def test_an_engine_without_a_tokenizer_takes_token_ids_only(llm):
    client = _start("thread", skip_tokenizer_init=True)
    try:
        with pytest.raises(ValueError, match="no tokenizer"):
            _collect(client, "text", "a text prompt", GREEDY)
        with pytest.raises(InvalidRequest, match="stop strings need a tokenizer") as e:
            _collect(client, "stop", PROMPTS[1], dataclasses.replace(GREEDY, stop=["x"]))
        assert e.value.param == "stop"
        out = _collect(client, "ids", PROMPTS[1], GREEDY)[-1]
        assert out.token_ids == llm.generate([PROMPTS[1]], GREEDY)[0].token_ids and out.text == ""
    finally:
        client.shutdown()
