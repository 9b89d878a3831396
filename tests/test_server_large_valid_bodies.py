"""Issue 21: a large, valid body (many prompts of many token ids) must not stall the event loop.

Its JSON is parsed in slices, its token-id prompts are checked on a worker thread and kept out of
the schema validation, its sequences are submitted to the engine in one batched call and aborted
with one message, and the answers (outputs, 400s) stay what they were. Nothing asserts on a
duration: the tests count calls, messages, threads and event-loop turns.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time

import httpx
import pytest

from flashlane.engine.client import EngineClient
from flashlane.engine.messages import AbortRequests, AddRequests, Call, Reply, StepOutputs
from flashlane.engine.outputs import RequestDelta, RequestOutput
from flashlane.engine.sampling_params import SamplingParams
from flashlane.server import request_params

from engine_models import preset
from server_harness import ENGINE_ARGS, LiveServer

MODEL = "tiny-flash"
MAX_LEN = ENGINE_ARGS["max_model_len"]
CMPL = "/v1/completions"
PADDING = "u" * (200 << 10)   # an ignored field that makes the body large (parsed on a thread)


@pytest.fixture(scope="module")
def server():
    with LiveServer(preset(MODEL), MODEL, transport="thread") as srv:
        yield srv


@pytest.fixture(scope="module")
def core_server():
    with LiveServer(preset(MODEL), MODEL, transport="process") as srv:
        yield srv


def _prompts(count: int, length: int) -> list[list[int]]:
    return [[1000 + (i * 31 + j) % 900 for j in range(length)] for i in range(count)]


def _on_event_loop() -> bool:
    try:
        asyncio.get_running_loop()
        return True
    except RuntimeError:
        return False


def _post(srv, body: dict) -> httpx.Response:
    return httpx.post(srv.url + CMPL, content=json.dumps(body), headers={"content-type": "application/json"},
                      timeout=300)


@pytest.mark.parametrize("which", ["server", "core_server"])
def test_a_large_token_id_batch_gives_the_same_greedy_outputs(which, request):
    """Through the large-body path (sliced parse, prompt kept out of validation, batched
    submission) the choices are those of the same prompts sent one by one in small bodies."""
    server = request.getfixturevalue(which)
    prompts = _prompts(6, 40)
    common = {"model": MODEL, "max_tokens": 6, "temperature": 0, "ignore_eos": True}
    r = _post(server, {**common, "prompt": prompts, "user": PADDING})
    assert r.status_code == 200, r.text
    got = [c["text"] for c in sorted(r.json()["choices"], key=lambda c: c["index"])]
    want = []
    for p in prompts:
        one = _post(server, {**common, "prompt": p})
        assert one.status_code == 200, one.text
        want.append(one.json()["choices"][0]["text"])
    assert got == want
    assert r.json()["usage"]["prompt_tokens"] == 6 * 40


def test_many_sequences_are_submitted_in_one_batched_engine_call(server, monkeypatch):
    engine = server.engine
    batches, singles = [], []
    real_many, real_one = engine.generate_many, engine.generate
    monkeypatch.setattr(engine, "generate_many", lambda reqs: batches.append(len(reqs)) or real_many(reqs))
    monkeypatch.setattr(engine, "generate", lambda *a: singles.append(a[0]) or real_one(*a))
    r = _post(server, {"model": MODEL, "prompt": _prompts(12, 30), "max_tokens": 2, "n": 2, "user": PADDING})
    assert r.status_code == 200, r.text
    assert len(r.json()["choices"]) == 24
    assert batches == [24] and singles == []


def test_token_ids_of_a_large_batch_are_checked_off_the_event_loop(server, monkeypatch):
    where = []
    real = request_params.check_prompt_ids
    monkeypatch.setattr(request_params, "check_prompt_ids",
                        lambda ids, *args: where.append(_on_event_loop()) or real(ids, *args))
    prompts = _prompts(200, 400)   # 80,000 ids; the last one outside the vocabulary, so nothing runs
    prompts[-1][-1] = server.engine.info.vocab_size
    r = _post(server, {"model": MODEL, "prompt": prompts, "max_tokens": 1})
    assert r.status_code == 400 and "outside the vocabulary" in r.json()["error"]["message"], r.text
    assert len(where) == 200 and not any(where)


def test_a_large_token_id_batch_is_kept_out_of_schema_validation(server, monkeypatch):
    """The prompt is checked on the worker thread that parsed the body (the schema would hold
    the GIL for all of it at once) and the endpoint gets the real prompt back."""
    from flashlane.server import token_id_prompts

    where = []
    real = token_id_prompts.is_id_batch
    monkeypatch.setattr(token_id_prompts, "is_id_batch", lambda p: where.append(_on_event_loop()) or real(p))
    prompts = _prompts(3, 20)
    r = _post(server, {"model": MODEL, "prompt": prompts, "max_tokens": 1, "user": PADDING})
    assert r.status_code == 200, r.text
    assert where == [False]
    assert len(r.json()["choices"]) == 3 and r.json()["usage"]["prompt_tokens"] == 60


def test_large_batches_refused_by_the_model_keep_their_messages(server):
    vocab = server.engine.info.vocab_size
    prompts = _prompts(200, 400)
    prompts[150][7] = vocab + 5
    r = _post(server, {"model": MODEL, "prompt": prompts, "max_tokens": 1, "user": PADDING})
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["message"] == f"token id {vocab + 5} is outside the vocabulary [0, {vocab})"
    assert err["param"] == "prompt"

    prompts = _prompts(100, 300) + [[7] * MAX_LEN]
    r = _post(server, {"model": MODEL, "prompt": prompts, "max_tokens": 1, "user": PADDING})
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded", r.text
    # what the schema refuses is still refused by the schema, with its message
    bad = _prompts(3, 10)
    bad[1][2] = True
    r = _post(server, {"model": MODEL, "prompt": bad, "max_tokens": 1, "user": PADDING})
    small = _post(server, {"model": MODEL, "prompt": bad, "max_tokens": 1})
    assert r.status_code == small.status_code == 400 and r.json() == small.json()


def test_sequences_go_to_the_engine_process_in_one_message_and_are_aborted_in_one(core_server, monkeypatch):
    transport = core_server.engine.transport
    sent = []
    real_send = transport.send
    monkeypatch.setattr(transport, "send", lambda msg: sent.append(msg) or real_send(msg))
    body = {"model": MODEL, "prompt": _prompts(20, 30), "max_tokens": MAX_LEN - 40, "ignore_eos": True,
            "stream": True, "user": PADDING}
    with httpx.Client(base_url=core_server.url, timeout=120) as c:
        with c.stream("POST", CMPL, json=body) as r:
            assert r.status_code == 200
            next(r.iter_lines())   # the first event: every sequence was submitted
    deadline = time.monotonic() + 60
    while not any(isinstance(m, AbortRequests) for m in sent) and time.monotonic() < deadline:
        time.sleep(0.05)
    monkeypatch.undo()
    adds = [m.command for m in sent if isinstance(m, Call) and isinstance(m.command, AddRequests)]
    aborts = [m for m in sent if isinstance(m, AbortRequests)]
    assert len(adds) == 1 and len(adds[0].requests) == 20
    assert len(aborts) == 1 and 0 < len(aborts[0].request_ids) <= 20
    core_server.wait_idle()


def test_an_aborted_batch_leaves_nothing_of_it_alive_in_the_engine_thread(server):
    """The stepping thread's loop once kept its last command's arguments and result alive until
    the next command: after an abort of many sequences, all their final outputs (with their
    prompts) stayed in memory. Nothing else is sent meanwhile (a /metrics poll is a command)."""
    import gc

    body = {"model": MODEL, "prompt": _prompts(12, 40), "max_tokens": 200, "temperature": 0,
            "ignore_eos": True, "stream": True}
    with httpx.Client(base_url=server.url, timeout=120) as c:
        with c.stream("POST", CMPL, json=body) as r:
            assert r.status_code == 200
            rid = json.loads(next(line for line in r.iter_lines() if line.startswith("data: "))[6:])["id"]
    engine = server.engine.transport.engine
    deadline = time.monotonic() + 60
    while any(k.startswith(rid) for k in list(engine.requests)):
        assert time.monotonic() < deadline, "the dropped stream's sequences were not aborted"
        time.sleep(0.05)
    gc.collect()
    kept = [o for o in gc.get_objects() if isinstance(o, RequestOutput) and o.request_id.startswith(rid)
            and o.finish_reason == "abort"]
    assert not kept, f"{len(kept)} aborted outputs still alive"


class _InstantTransport:
    """An engine that finishes every request it is given at once, all of them in one step."""

    info, tokenizer, restarts, generation, retry_after = None, None, 0, 0, None
    alive, state, error = True, "running", None

    def start(self, on_message, on_death) -> None:
        self.on_message = on_message

    def send(self, msg) -> None:
        if isinstance(msg, Call):
            self.on_message(Reply(msg.call_id))
            if isinstance(msg.command, AddRequests):
                self.on_message(StepOutputs([RequestDelta(r.request_id, [2], None, time.monotonic(), "length")
                                             for r in msg.command.requests]))

    def shutdown(self, timeout: float) -> None:
        pass


def test_merged_outputs_let_the_event_loop_run_while_many_are_handed_on():
    client = EngineClient(_InstantTransport())
    client.start()

    async def run() -> tuple[int, int]:
        requests = [(f"r{i}", [1], SamplingParams(max_tokens=1)) for i in range(1000)]
        ticks = 0
        stop = threading.Event()

        async def heartbeat():
            nonlocal ticks
            while not stop.is_set():
                ticks += 1
                await asyncio.sleep(0)

        beat = asyncio.create_task(heartbeat())
        seen = 0
        async for _ in client.generate_many(requests):
            if seen == 0:   # every output is queued by now: only the merge itself may let the loop run
                ticks = 0
            seen += 1
        during = ticks
        stop.set()
        await beat
        return seen, during

    seen, ticks = asyncio.run(run())
    assert seen == 1000 and ticks > 0


def test_a_sliced_parse_is_json_loads():
    from flashlane.server.json_slices import loads_in_slices

    docs = ['{"prompt": [[1, 2], [3]], "n": 1, "n": 2}', '[[], {"a": [1, {"b": 2}]}, "x"]', " 7 ", '"\\ud800"',
            '{"a": 1,}', '{"a" 1}', "[1 2]", '{"a": 1} x', "", '{"a": NaN}']
    for doc in docs:
        for body in (doc, doc.encode(), bytearray(doc.encode()), b"\xef\xbb\xbf" + doc.encode(),
                     doc.encode("utf-16")):
            outcomes = []
            for parse in (json.loads, loads_in_slices):
                try:
                    outcomes.append(("ok", repr(parse(body))))
                except ValueError as exc:
                    outcomes.append((type(exc).__name__, str(exc)))
            assert outcomes[0] == outcomes[1], (doc, body)
