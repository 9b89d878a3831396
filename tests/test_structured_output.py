"""Structured output (SamplingParams.structured / response_format): sampled outputs of a random
tiny model follow the schema, the mask covers the logits' width, a constrained request leaves
its batch neighbours alone, preemption and the engine-core process keep it, bad schemas are 400s."""

from __future__ import annotations

import asyncio
import json

import jsonschema_rs
import pytest
import torch

from flashlane import LLM, SamplingParams
from flashlane.engine.launch import engine_in_process
from flashlane.engine.sampling_params import StructuredOutput
from flashlane.engine.structured_output import Grammars

from engine_models import preset, random_prompts
from server_harness import ENGINE_ARGS, LiveServer

MODEL = "tiny-flash"
# valid outputs are short (bounded strings, an enum, a bounded integer): a random model finishes
SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "age", "pet"],
          "properties": {"name": {"type": "string", "maxLength": 6},
                         "age": {"type": "integer", "minimum": 0, "maximum": 99},
                         "pet": {"enum": ["cat", "dog", "eel"]}}}
VALIDATOR = jsonschema_rs.validator_for(SCHEMA)
FORMAT = {"type": "json_schema", "json_schema": {"name": "pet_owner", "schema": SCHEMA, "strict": True}}


def constrained(**kw) -> SamplingParams:
    return SamplingParams(structured=StructuredOutput(json_schema=SCHEMA), **{"max_tokens": 64, **kw})


def assert_valid(text: str) -> None:
    VALIDATOR.validate(json.loads(text))


@pytest.fixture(scope="module")
def loaded():
    return preset(MODEL)


@pytest.fixture(scope="module")
def llm(loaded):
    return LLM(loaded, **ENGINE_ARGS)


@pytest.fixture(scope="module")
def server(loaded):
    with LiveServer(loaded, MODEL) as srv:
        yield srv


def test_sampled_outputs_follow_the_schema(llm):
    outs = llm.generate(["Hello"] * 20, [constrained(temperature=1.0, seed=i) for i in range(20)])
    for o in outs:
        assert o.finish_reason == "stop" and o.stop_reason is None, o
        assert_valid(o.text)
    assert len({o.text for o in outs}) > 10   # really sampled, not one answer


def test_mask_spans_the_logits_and_allows_eos_only_at_the_end(loaded):
    tok, eos = loaded.tokenizer, loaded.config.eos_token_ids
    width = tok.vocab_size + 40                       # a model whose logits are wider than its vocabulary
    grammars = Grammars(tok, width, eos)
    m = grammars.matcher(StructuredOutput(json_object=True))
    logits = torch.zeros(1, width)
    grammars.mask(logits, [m])
    allowed = torch.isfinite(logits[0]).nonzero().flatten().tolist()
    assert allowed and all(tok.decode([t]).startswith("{") for t in allowed)
    assert not torch.isfinite(logits[0, tok.vocab_size:]).any()
    for t in tok.encode('{"a": [1, 2]}', add_special_tokens=False):
        assert not m.finished
        assert m.accept(t)
    assert m.finished
    logits = torch.zeros(1, width)
    grammars.mask(logits, [m])
    assert sorted(torch.isfinite(logits[0]).nonzero().flatten().tolist()) == sorted(eos)
    m.rollback(1)                                     # speculative decoding's seam
    assert not m.finished
    with pytest.raises(ValueError, match="structured.*tokenizer"):
        Grammars(None, width, eos).matcher(StructuredOutput(json_object=True))


def test_constrained_request_leaves_its_batch_alone(llm):
    prompts = ["The cache holds", "Once upon a time", "def add(a, b):"]
    free = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    alone = [llm.generate([p], free)[0].token_ids for p in prompts[1:]]
    constrained_alone = llm.generate([prompts[0]], constrained(temperature=0))[0]
    together = llm.generate(prompts, [constrained(temperature=0), free, free])
    assert together[0].token_ids == constrained_alone.token_ids
    assert_valid(together[0].text)
    assert [o.token_ids for o in together[1:]] == alone
    seeded = [constrained(temperature=1.0, seed=7), SamplingParams(max_tokens=8, temperature=1.0, seed=8)]
    assert ([o.token_ids for o in llm.generate(prompts[:2], seeded)]
            == [llm.generate([p], s)[0].token_ids for p, s in zip(prompts[:2], seeded)])


def test_preemption_does_not_feed_the_grammar_twice(loaded):
    prompts = random_prompts(6, 40, 90, 4000, seed=2)
    params = constrained(temperature=0, max_tokens=40)
    free = LLM(loaded, **ENGINE_ARGS).generate(prompts, params)
    tight = LLM(loaded, dtype="float32", num_pages=12, num_slots=8, page_size=16, max_num_batched_tokens=128)
    pressed = tight.generate(prompts, params)
    assert tight.engine.scheduler.num_preemptions >= 2
    assert [o.token_ids for o in pressed] == [o.token_ids for o in free]
    for o in pressed:
        assert o.finish_reason == "stop"
        assert_valid(o.text)


def test_llm_refuses_a_bad_schema_and_a_missing_tokenizer(llm, loaded):
    with pytest.raises(ValueError, match="structured.json_schema.*Invalid type"):
        llm.generate(["x"], SamplingParams(structured=StructuredOutput(json_schema={"type": "strng"})))
    with pytest.raises(ValueError, match="structured"):
        StructuredOutput(json_schema=SCHEMA, json_object=True)
    assert not llm.engine.has_unfinished() and not llm.engine.requests


def test_server_completions_and_chat_follow_the_schema(server):
    with server.client() as c:
        r = c.post("/v1/completions", json={"model": MODEL, "prompt": ["Hello", "A list:"], "n": 5, "seed": 1,
                                            "max_tokens": 64, "temperature": 1.0, "response_format": FORMAT})
        assert r.status_code == 200, r.text
        texts = [ch["text"] for ch in r.json()["choices"]]
        r = c.post("/v1/chat/completions", json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                                                 "n": 10, "seed": 2, "max_tokens": 64, "temperature": 1.0,
                                                 "response_format": FORMAT})
        assert r.status_code == 200, r.text
        choices = r.json()["choices"]
        assert all(ch["finish_reason"] == "stop" for ch in choices)
        texts += [ch["message"]["content"] for ch in choices]
    assert len(texts) == 20
    for t in texts:
        assert_valid(t)


def test_server_json_object(server):
    with server.client() as c:
        r = c.post("/v1/chat/completions", json={"model": MODEL, "messages": [{"role": "user", "content": "{"}],
                                                 "n": 16, "seed": 0, "max_tokens": 48, "temperature": 1.0,
                                                 "response_format": {"type": "json_object"}})
        assert r.status_code == 200, r.text
    choices = r.json()["choices"]
    assert all(ch["message"]["content"].startswith("{") for ch in choices)
    done = [ch["message"]["content"] for ch in choices if ch["finish_reason"] == "stop"]
    assert done   # a random model's strings run long: some, not all, close within 48 tokens
    assert all(isinstance(json.loads(t), dict) for t in done)


@pytest.mark.parametrize("fmt, why", [
    ({"type": "json_schema", "json_schema": {"name": "x"}}, "needs json_schema.schema"),
    ({"type": "json_schema"}, "needs json_schema.schema"),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strng"}}}, "Invalid type"),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "required": ["a"], "properties": {"a": {"type": "string", "minLength": 3,
                                                                  "maxLength": 1}}}}}, "nsatisfiable"),
    ({"type": "xml"}, "response_format.type"),
])
def test_server_bad_response_format_is_a_400(server, fmt, why):
    with server.client() as c:
        for path, body in (("/v1/completions", {"prompt": "x"}),
                           ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]})):
            r = c.post(path, json={"model": MODEL, "max_tokens": 4, "response_format": fmt, **body})
            assert r.status_code == 400, r.text
            err = r.json()["error"]
            assert err["param"].startswith("response_format") and why in err["message"] + err["param"], err


def test_engine_core_process(llm):
    ref = llm.generate(["Hello"], constrained(temperature=0))[0]
    core = engine_in_process(MODEL, **ENGINE_ARGS, num_threads=1)
    core.start()

    async def collect(rid, params):
        return [out async for out in core.generate(rid, "Hello", params)]
    try:
        outs = asyncio.run(collect("c0", constrained(temperature=0)))
        assert outs[-1].token_ids == ref.token_ids and outs[-1].finish_reason == "stop"
        with pytest.raises(ValueError, match="structured.json_schema.*Invalid type"):
            asyncio.run(collect("c1", SamplingParams(structured=StructuredOutput(json_schema={"type": "strng"}))))
    finally:
        core.shutdown()
