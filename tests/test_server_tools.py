"""Tool calling over HTTP through the openai client (tiny-flash, random weights): forced choices are
decoded under a grammar, so even a random model answers with valid calls; tool results render;
the 400s. And the chat stream's first chunk: it carries the role with the first token, never before."""

from __future__ import annotations

import json

import httpx
import jsonschema_rs
import openai
import pytest

from engine_models import preset
from server_harness import LiveServer

MODEL = "tiny-flash"
WEATHER = {"type": "object",
           "properties": {"city": {"type": "string", "enum": ["Paris", "Rome", "Oslo"]},
                          "days": {"type": "integer", "minimum": 1, "maximum": 7}},
           "required": ["city", "days"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "forecast", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "now"}}]   # no parameters: an empty arguments object
SCHEMAS = {"get_weather": WEATHER, "now": {"type": "object", "maxProperties": 0}}
ASK = [{"role": "user", "content": "Weather in Rome for two days?"}]
NAMED = {"type": "function", "function": {"name": "get_weather"}}
PLAIN = [{"role": "user", "content": "The cache holds"}]


@pytest.fixture(scope="module")
def loaded():
    return preset(MODEL)


@pytest.fixture(scope="module")
def server(loaded):
    with LiveServer(loaded, MODEL) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def _create(client, **kw):
    return client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, max_tokens=48, seed=7, **kw)


def _streamed_calls(chunks) -> list[dict]:
    calls: list[dict] = []
    for c in chunks:
        for d in (c.choices[0].delta.tool_calls or []) if c.choices else []:
            if d.id is not None:
                assert d.index == len(calls) and d.type == "function" and d.function.name
                calls.append({"id": d.id, "name": d.function.name, "arguments": d.function.arguments or ""})
            else:
                assert d.function.name is None
                calls[d.index]["arguments"] += d.function.arguments
    return calls


@pytest.mark.parametrize("choice", ["required", NAMED], ids=["required", "named"])
def test_forced_tool_choice_returns_valid_calls_streamed_or_not(client, choice):
    r = _create(client, tool_choice=choice, parallel_tool_calls=False)
    c = r.choices[0]
    assert c.finish_reason == "tool_calls" and c.message.content is None and c.message.tool_calls
    for call in c.message.tool_calls:
        assert call.id.startswith("call_") and call.type == "function"
        jsonschema_rs.validate(SCHEMAS[call.function.name], json.loads(call.function.arguments))
    assert len(c.message.tool_calls) == 1   # parallel_tool_calls false
    if choice == NAMED:
        assert c.message.tool_calls[0].function.name == "get_weather"

    chunks = list(_create(client, tool_choice=choice, parallel_tool_calls=False, stream=True))
    first = chunks[0].choices[0]
    assert first.delta.role == "assistant" and first.delta.tool_calls[0].function.name   # role with the call
    assert not any(ch.choices[0].delta.content for ch in chunks)
    assert [ch.choices[0].finish_reason for ch in chunks][-1] == "tool_calls"
    # the same seed: the fragments join to the non-streamed calls exactly
    assert [(s["name"], s["arguments"]) for s in _streamed_calls(chunks)] == [
        (t.function.name, t.function.arguments) for t in c.message.tool_calls]


def test_a_tool_result_renders_into_the_prompt(client, loaded):
    history = ASK + [
        {"role": "assistant", "content": None,
         "tool_calls": [{"id": "call_1", "type": "function",
                         "function": {"name": "get_weather", "arguments": '{"city": "Rome", "days": 2}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 24C"}]
    r = client.chat.completions.create(model=MODEL, messages=history, tools=TOOLS, tool_choice="none",
                                       max_tokens=2, temperature=0)
    as_template_sees_it = history[:1] + [
        {**history[1], "content": "", "tool_calls": [{**history[1]["tool_calls"][0], "function": {
            "name": "get_weather", "arguments": {"city": "Rome", "days": 2}}}]}, history[2]]
    text = loaded.tokenizer.apply_chat_template(as_template_sees_it, add_generation_prompt=True, tools=TOOLS)
    assert "<arg_value>Rome</arg_value>" in text and "<tool_response>\nsunny, 24C\n</tool_response>" in text
    assert r.usage.prompt_tokens == len(loaded.tokenizer.encode(text))
    assert r.choices[0].message.tool_calls is None   # "none": plain content


@pytest.mark.parametrize("extra,param", [
    ({"functions": [{"name": "f", "parameters": {}}]}, "functions"),
    ({"function_call": "auto"}, "function_call"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "has space"}}]}, "tools.0.function.name"),
])
def test_bad_tool_fields_are_400s_naming_the_field(server, extra, param):
    body = {"model": MODEL, "messages": ASK, "max_tokens": 1, **extra}
    r = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_the_first_chunk_of_each_choice_comes_with_its_first_token(client):
    chunks = list(client.chat.completions.create(
        model=MODEL, messages=PLAIN, n=2, max_tokens=5, temperature=0,
        logprobs=True, stream=True, stream_options={"include_usage": True}, extra_body={"ignore_eos": True}))
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 10
    for i in range(2):
        mine = [c.choices[0] for c in chunks if c.choices and c.choices[0].index == i]
        # one chunk per generated token, each carrying that token: none precedes the first token
        assert len(mine) == 5 and all(len(c.logprobs.content) == 1 for c in mine)
        assert mine[0].delta.role == "assistant" and all(c.delta.role is None for c in mine[1:])
        assert mine[0].delta.content == mine[0].logprobs.content[0].token == " cle"   # greedy's first token
        assert mine[-1].finish_reason == "length"


def test_a_choice_with_no_text_still_gets_one_chunk_with_the_role(client):
    # greedy's first token is " cle" (above): stopping at it leaves the choice no text at all
    chunks = list(client.chat.completions.create(model=MODEL, messages=PLAIN, max_tokens=3, temperature=0,
                                                 stop=[" cle"], stream=True, extra_body={"ignore_eos": True}))
    assert len(chunks) == 1
    c = chunks[0].choices[0]
    assert c.delta.role == "assistant" and not c.delta.content and c.finish_reason == "stop"


def test_the_openapi_schema_refuses_the_deprecated_fields(server):

    doc = httpx.get(server.url + "/openapi.json", timeout=60).json()
    schema = jsonschema_rs.Draft202012Validator({"$ref": "#/components/schemas/ChatCompletionRequest",
                                                 "components": doc["components"]})
    body = {"model": MODEL, "messages": ASK, "tools": TOOLS, "tool_choice": NAMED}
    assert schema.is_valid(body)
    assert not schema.is_valid({**body, "functions": [{"name": "f"}]})
