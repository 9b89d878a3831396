"""Tool-call parsers (GLM, Hermes, forced choices), their schemas and the request checks, without a
server: whole answers, and the same answers streamed in pieces that split the markup anywhere."""

from __future__ import annotations

import json

import jsonschema_rs
import pytest

from flashlane.server.chat import render_chat
from flashlane.server.errors import APIError
from flashlane.server.protocol import ChatCompletionRequest
from flashlane.server.tools import CallFolder, call_format, parse_whole, plan_tools
from flashlane.server.tools.forced import NamedCallParser, RequiredCallsParser
from flashlane.server.tools.glm import glm_parser
from flashlane.server.tools.hermes import hermes_parser
from flashlane.server.tools.prompt import with_tools_as_text
from flashlane.server.tools.schema import required_schema

WEATHER = {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
           "required": ["city"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "now"}}]
PARAMS = {"get_weather": WEATHER["properties"], "now": {}}

GLM = ("Let me check.\n<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>42</arg_value>\n"
       "<arg_key>days</arg_key>\n<arg_value>3</arg_value>\n</tool_call>\n<tool_call>now\n</tool_call>")
GLM_CALLS = [("get_weather", {"city": "42", "days": 3}), ("now", {})]   # "42" stays a string: its schema says so
HERMES = ('I will look. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Pa\\"ris }", "days": 2}}\n'
          '</tool_call>\n<tool_call>{"arguments": {}, "name": "now"}</tool_call>')
HERMES_CALLS = [("get_weather", {"city": 'Pa"ris }', "days": 2}), ("now", {})]


def streamed(parser, text: str, step: int):
    """(content, calls, deltas) of ``text`` fed ``step`` chars at a time."""
    deltas = [parser.feed(text[i:i + step]) for i in range(0, len(text), step)] + [parser.finish()]
    folder = CallFolder()
    for d in deltas:
        folder.add(d)
    return "".join(d.content for d in deltas), folder.calls, deltas


def named(calls):
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls]


@pytest.mark.parametrize("make,text,content,calls", [
    (lambda: glm_parser(PARAMS), GLM, "Let me check.\n", GLM_CALLS),
    (hermes_parser, HERMES, "I will look. ", HERMES_CALLS),
])
def test_whole_and_streamed_answers_agree(make, text, content, calls):
    got_content, got_calls = parse_whole(make(), text)
    assert got_content == content and named(got_calls) == calls
    assert all(c["id"].startswith("call_") and len(c["id"]) == 29 and c["type"] == "function" for c in got_calls)
    for step in (1, 2, 3, 7, len(text)):
        s_content, s_calls, deltas = streamed(make(), text, step)
        assert s_content == content, step
        # the same arguments text, char for char, as the whole answer's
        assert [c["function"]["arguments"] for c in s_calls] == [c["function"]["arguments"] for c in got_calls]
        assert not any("<" in d.content and "tool" in d.content for d in deltas), "markup leaked into content"
        heads = [c for d in deltas for c in d.calls if c.name is not None]
        assert [h.index for h in heads] == [0, 1] and len({h.id for h in heads}) == 2


def test_a_partial_open_tag_is_held_back_until_decided():
    p = hermes_parser()
    assert p.feed("a <tool").content == "a "
    assert p.feed("box> b").content == "<toolbox> b"   # not a tag after all: released
    assert p.feed(" <tool_c").content == " "
    d = p.feed('all>{"name": "now", "arguments": {}}</tool_call>')
    assert d.content == "" and d.calls[0].name == "now" and d.calls[0].arguments == "{}"


def test_text_after_a_call_is_not_content_and_parallel_false_keeps_one_call():
    content, calls = parse_whole(glm_parser(PARAMS, max_calls=1), GLM + " bye")
    assert content == "Let me check.\n" and named(calls) == GLM_CALLS[:1]


def test_blocks_that_are_not_calls_are_content():
    assert parse_whole(hermes_parser(), "x <tool_call>oops</tool_call> <tool_c") == (
        "x <tool_call>oops</tool_call> <tool_c", [])
    assert parse_whole(glm_parser(PARAMS), "<tool_call>\n</tool_call>") == ("<tool_call>\n</tool_call>", [])
    # truncated inside a named call: the complete pairs, closed
    content, calls = parse_whole(glm_parser(PARAMS), "<tool_call>get_weather\n<arg_key>city</arg_key>\n"
                                                     "<arg_value>Rome</arg_value>\n<arg_key>da")
    assert content is None and named(calls) == [("get_weather", {"city": "Rome"})]


def test_glm_values_follow_the_schema_else_json_else_text():
    schema = {"f": {"s": {"type": "string"}, "n": {"type": ["integer", "null"]}}}
    text = ("<tool_call>f\n<arg_key>s</arg_key>\n<arg_value>[1]</arg_value>\n<arg_key>n</arg_key>\n"
            "<arg_value> 7 </arg_value>\n<arg_key>u</arg_key>\n<arg_value>not json</arg_value>\n"
            "<arg_key>l</arg_key>\n<arg_value>[1, \"a\"]</arg_value>\n</tool_call>")
    _, calls = parse_whole(glm_parser(schema), text)
    assert named(calls) == [("f", {"s": "[1]", "n": 7, "u": "not json", "l": [1, "a"]})]


def test_required_and_named_outputs_stream_to_the_same_calls():
    text = '[{"name": "get_weather", "parameters": {"city": "Oslo", "days": 1}}, {"name": "now", "parameters": {}}]'
    whole = parse_whole(RequiredCallsParser(), text)
    assert whole[0] is None and named(whole[1]) == [("get_weather", {"city": "Oslo", "days": 1}), ("now", {})]
    for step in (1, 5):
        _, calls, _ = streamed(RequiredCallsParser(), text, step)
        assert [c["function"]["arguments"] for c in calls] == [c["function"]["arguments"] for c in whole[1]]
    _, calls, deltas = streamed(NamedCallParser("get_weather"), ' {"city": "Oslo"} ', 1)
    assert calls[0]["function"] == {"name": "get_weather", "arguments": '{"city": "Oslo"}'}
    assert deltas[0].calls[0].name == "get_weather"   # announced on the first token
    assert parse_whole(RequiredCallsParser(), "no json") == ("no json", [])


def test_required_schema_accepts_calls_of_the_tools_only():
    schema = required_schema(TOOLS, parallel=True)
    assert jsonschema_rs.is_valid(schema, [{"name": "get_weather", "parameters": {"city": "x"}},
                                           {"name": "now", "parameters": {}}])
    for bad in ([], [{"name": "other", "parameters": {}}], [{"name": "get_weather", "parameters": {"days": 1}}]):
        assert not jsonschema_rs.is_valid(schema, bad)
    assert not jsonschema_rs.is_valid(required_schema(TOOLS, parallel=False), [{"name": "now", "parameters": {}}] * 2)


def _request(**kw):
    return ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], **kw)


@pytest.mark.parametrize("kw,param,words", [
    ({"tool_choice": "required"}, "tool_choice", "needs 'tools'"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "missing"}}}, "tool_choice",
     "not in 'tools'"),
    ({"tools": TOOLS + TOOLS[:1]}, "tools.2.function.name", "unique"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}]},
     "tools.0.function.parameters", "'object'"),
])
def test_bad_tool_requests_name_the_field(kw, param, words):
    with pytest.raises(APIError) as e:
        plan_tools(_request(**kw))
    assert e.value.status == 400 and e.value.param == param and words in e.value.message


def test_plans_and_grammars():
    assert plan_tools(_request()).choice == "none" and plan_tools(_request(tools=TOOLS)).choice == "auto"
    plan = plan_tools(_request(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_weather"}}))
    assert plan.structured().json_schema == WEATHER and isinstance(plan.parser("glm"), NamedCallParser)
    assert plan_tools(_request(tools=TOOLS, tool_choice="none")).parser("glm") is None


class _Template:
    """A tokenizer whose template ignores tools (SmolLM2's ChatML, shortened)."""

    chat_template = "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"

    def apply_chat_template(self, messages, add_generation_prompt=True, **extra):
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        return ImmutableSandboxedEnvironment().from_string(self.chat_template).render(messages=messages)


HISTORY = [{"role": "user", "content": "Weather?"},
           {"role": "assistant", "content": None,
            "tool_calls": [{"id": "c1", "type": "function",
                            "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'}}]},
           {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]


def test_a_template_without_tools_gets_them_as_hermes_text():
    msgs = ChatCompletionRequest(messages=HISTORY).messages
    text = render_chat(_Template(), msgs, TOOLS)
    assert text.startswith("<|im_start|>system\n# Tools") and json.dumps(TOOLS[0]) in text
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>' in text
    assert "<|im_start|>user\n<tool_response>\nsunny\n</tool_response>" in text
    assert call_format(_Template()) == "hermes"
    plain = with_tools_as_text([{"role": "system", "content": "Be brief."}], TOOLS)
    assert plain[0]["content"].startswith("Be brief.\n\n# Tools")


def test_bad_history_arguments_are_a_400():
    msgs = ChatCompletionRequest(messages=[{**HISTORY[1], "tool_calls": [
        {"type": "function", "function": {"name": "f", "arguments": "[1]"}}]}]).messages
    with pytest.raises(APIError) as e:
        render_chat(_Template(), msgs)
    assert e.value.param == "messages.0.tool_calls.0.function.arguments"


def _deltas(pieces: list[str], reason: str = "stop"):
    """A stream's outputs (OutputKind.DELTA): one token and its piece of text each."""
    from flashlane.engine.outputs import RequestOutput

    for i, piece in enumerate(pieces):
        last = i == len(pieces) - 1
        yield RequestOutput("r", [1], piece, [i], last, reason if last else None, num_output_tokens=i + 1)


def _final(pieces: list[str], reason: str = "stop"):
    """The same answer's one output when it is not streamed (OutputKind.FINAL_ONLY)."""
    from flashlane.engine.outputs import RequestOutput

    return RequestOutput("r", [1], "".join(pieces), list(range(len(pieces))), True, reason,
                         num_output_tokens=len(pieces))


def test_auto_choice_stream_and_answer_in_openai_shapes():
    """The chat handler's per-choice shaping of a GLM answer, token by token as the engine sends it."""
    from flashlane.server.chat_completions import _ChoiceStream, answer, finish_reason

    plan = plan_tools(_request(tools=TOOLS))
    pieces = ["Let", " me check.", "\n<tool", "_call>get_", "weather\n<arg_key>city</arg_key>\n<arg_val",
              "ue>Rome</arg_value>\n<arg_key>days</arg_key>\n<arg_value>2", "</arg_value>\n</tool_call>"]
    choice = _ChoiceStream(plan, "glm")
    deltas = [choice.delta(out, must_send=out.finished) for out in _deltas(pieces)]
    sent = [d for d in deltas if d is not None]
    assert sent[0] == {"role": "assistant", "content": "Let"} and all("role" not in d for d in sent[1:])
    assert "".join(d.get("content") or "" for d in sent) == "Let me check.\n"
    calls = [c for d in sent for c in d.get("tool_calls", [])]
    assert calls[0]["index"] == 0 and calls[0]["type"] == "function" and calls[0]["id"].startswith("call_")
    assert calls[0]["function"]["name"] == "get_weather"
    assert all(set(c) == {"index", "function"} and set(c["function"]) == {"arguments"} for c in calls[1:])
    arguments = "".join(c["function"]["arguments"] for c in calls)
    assert json.loads(arguments) == {"city": "Rome", "days": 2}
    last = _final(pieces)
    assert choice.called and finish_reason(last, choice.called) == "tool_calls"
    message, reason = answer(plan, "glm", last)
    assert reason == "tool_calls" and message["content"] == "Let me check.\n"
    assert message["tool_calls"][0]["function"]["arguments"] == arguments
    # tool_choice "none": the same text is plain content
    assert answer(plan_tools(_request(tools=TOOLS, tool_choice="none")), "glm", last) == (
        {"role": "assistant", "content": "".join(pieces)}, "stop")


def test_a_schema_the_grammar_cannot_enforce_is_a_400_naming_the_tool():
    bad = [TOOLS[0], {"type": "function", "function": {"name": "f", "parameters": {"type": "object",
                                                                                   "properties": 5}}}]
    with pytest.raises(APIError) as e:
        plan_tools(_request(tools=bad, tool_choice="required")).structured()
    assert e.value.status == 400 and e.value.param == "tools.1.function.parameters"
    named_ok = {"type": "function", "function": {"name": "get_weather"}}
    assert plan_tools(_request(tools=bad, tool_choice=named_ok)).structured().json_schema == WEATHER
