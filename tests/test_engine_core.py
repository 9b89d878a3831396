"""The engine core (engine/core.py) on its typed messages, without a transport: commands answer
with a Reply (an exception included, the core going on), aborts send the request's last delta,
an add is all or none, anything that is not a message for the core is a TypeError, the one step
loop turns a scripted inbox into the offline LLM's tokens, and every message survives the pipe."""

from __future__ import annotations

import dataclasses
import pickle

import pytest

from flashlane import LLM, SamplingParams
from flashlane.engine.core import EngineCore, run_core_loop
from flashlane.engine.llm_engine import LLMEngine
from flashlane.engine.messages import (AbortAll, AbortRequests, AddRequests, Call, EngineDied, LoadFailed, NewRequest,
                                       Ready, Reply, StartProfile, StepOutputs, StepPage, Stop, StopProfile,
                                       TakeSnapshot)
from flashlane.engine.outputs import RequestDelta
from flashlane.engine.request_check import InvalidRequest

from engine_models import tiny_llama

ARGS = dict(dtype="float32", cache_memory=8 << 20, max_model_len=256)
GREEDY = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
LONG = SamplingParams(max_tokens=200, temperature=0, ignore_eos=True)


@pytest.fixture
def core():
    return EngineCore(LLMEngine(tiny_llama(), **ARGS))


def _add(*requests: tuple[str, list[int], SamplingParams], call_id: int = 0) -> Call:
    return Call(call_id, AddRequests([NewRequest(rid, ids, p, 0.0) for rid, ids, p in requests]))


def _handle(core: EngineCore, msg) -> list:
    sent = []
    assert core.handle(msg, sent.append)
    return sent


def test_a_command_is_answered_by_a_reply_even_when_it_fails(core):
    assert _handle(core, _add(("a", [5, 6, 7], GREEDY), call_id=7)) == [Reply(7)]
    assert core.has_work and "a" in core.engine.requests
    (reply,) = _handle(core, _add(("b", [1] * 300, GREEDY), call_id=8))
    assert reply.call_id == 8 and isinstance(reply.error, InvalidRequest) and reply.error.param == "prompt"
    (reply,) = _handle(core, Call(9, StopProfile("/nowhere")))
    assert isinstance(reply.error, RuntimeError) and "no profiling window" in str(reply.error)
    (reply,) = _handle(core, Call(10, TakeSnapshot()))
    assert reply.error is None and reply.value["waiting"] == 1 and "finish_reasons" in reply.value


def test_an_add_is_all_or_none(core):
    (reply,) = _handle(core, _add(("ok", [5, 6], LONG), ("refused", [5, 10 ** 6], GREEDY)))
    assert isinstance(reply.error, InvalidRequest)
    assert not core.engine.requests and not core.has_work   # nobody waits for "ok": no delta either


def test_aborts_send_the_last_delta_of_what_still_runs(core):
    _handle(core, _add(("a", [5, 6], LONG), ("b", [7, 8], LONG), ("c", [9, 10], LONG)))
    sent = []
    core.step(sent.append)
    (step,) = sent
    assert isinstance(step, StepOutputs) and sorted(d.request_id for d in step.deltas) == ["a", "b", "c"]
    (out,) = _handle(core, AbortRequests(["a", "not-there"], "stop"))
    assert [(d.request_id, d.finish_reason, d.token_ids) for d in out.deltas] == [("a", "stop", [])]
    assert _handle(core, AbortRequests(["a"])) == []       # already ended: nothing to send
    out, reply = _handle(core, Call(3, AbortAll()))
    assert sorted((d.request_id, d.finish_reason) for d in out.deltas) == [("b", "abort"), ("c", "abort")]
    assert reply == Reply(3) and not core.has_work
    assert core.engine.finish_reasons == {"stop": 1, "abort": 2}


def test_what_is_not_a_message_for_the_core_is_a_type_error(core):
    for wrong in (("add", []), Reply(1), TakeSnapshot(), "stop"):
        with pytest.raises(TypeError, match="not a message for it"):
            core.handle(wrong, lambda msg: None)
    (reply,) = _handle(core, Call(1, "snapshot"))   # not a command: that call fails, the core goes on
    assert reply.call_id == 1 and reply.error is not None
    assert _handle(core, Call(2, TakeSnapshot()))[0].error is None
    assert core.handle(Stop(), lambda msg: None) is False


class ScriptedInbox:
    """Each take() hands on the next batch of messages; Stop once the script is done."""

    def __init__(self, *batches: list):
        self.batches = list(batches)
        self.waits: list[bool] = []

    def take(self, wait: bool) -> list:
        self.waits.append(wait)
        if self.batches:
            return self.batches.pop(0)
        return [Stop()] if wait else []


def test_the_step_loop_gives_the_offline_llms_tokens():
    prompts = {"a": [5, 6, 7, 8], "b": list(range(10, 40))}
    want = LLM(tiny_llama(), **ARGS).generate(list(prompts.values()), GREEDY)
    core = EngineCore(LLMEngine(tiny_llama(), **ARGS))
    inbox = ScriptedInbox([_add(*((rid, ids, GREEDY) for rid, ids in prompts.items()))], [Call(1, StepPage(None, 50, True))])
    sent = []
    run_core_loop(core, inbox, sent.append)
    assert inbox.waits[0] is True                 # nothing to do: it blocks for messages
    assert inbox.waits[-1] is True and not core.has_work
    got = {rid: [] for rid in prompts}
    finished = {}
    replies = [m for m in sent if isinstance(m, Reply)]
    for msg in sent:
        if isinstance(msg, StepOutputs):
            for d in msg.deltas:
                got[d.request_id] += d.token_ids
                if d.finished:
                    finished[d.request_id] = d.finish_reason
    assert [got[rid] for rid in prompts] == [w.token_ids for w in want]
    assert finished == {"a": "length", "b": "length"}
    assert replies[0] == Reply(0) and replies[1].call_id == 1 and replies[1].value["total"] >= 1


def test_every_message_survives_the_pipe():
    delta = RequestDelta("r", [5, 6], [{5: -0.1}, {6: -0.2}], 1.5, "stop", 6, num_cached_tokens=16,
                         num_preemptions=1, first_scheduled_time=1.0, prompt_logprobs=[None, {3: -1.0}])
    messages = [_add(("r", [1, 2], dataclasses.replace(GREEDY, stop=["x"]))), Call(2, AbortAll()),
                Call(3, TakeSnapshot()), Call(4, StepPage(1.0, 10, False)), Call(5, StartProfile()),
                Call(6, StopProfile("/tmp/x")), AbortRequests(["r"], "stop"), Stop(), Ready(None, None),
                StepOutputs([delta]), Reply(1, value={"a": 1}), EngineDied("boom", "Traceback ...")]
    for msg in messages:
        assert pickle.loads(pickle.dumps(msg)) == msg, msg
    refusal = pickle.loads(pickle.dumps(Reply(1, error=InvalidRequest("too long", "max_tokens", "context_length_exceeded"))))
    assert (refusal.error.message, refusal.error.param, refusal.error.code) == ("too long", "max_tokens",
                                                                               "context_length_exceeded")
    failed = pickle.loads(pickle.dumps(LoadFailed(ValueError("bad arg"))))
    assert isinstance(failed.error, ValueError) and str(failed.error) == "bad arg"


def test_the_engine_sends_token_ids_and_no_text():
    fields = {f.name for f in dataclasses.fields(RequestDelta)}
    assert not fields & {"text", "delta_text", "prompt"}
