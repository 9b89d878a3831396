"""Chat rendering: the tokenizer's template, a fallback layout, and template errors as 400s."""

from __future__ import annotations

import pytest

from flashlane.server.chat import render_chat
from flashlane.server.errors import APIError
from flashlane.server.protocol import ChatCompletionRequest

from engine_models import ByteTokenizer


def _messages(*pairs):
    return ChatCompletionRequest(messages=[{"role": r, "content": c} for r, c in pairs]).messages


def test_fallback_layout_without_a_template():
    text = render_chat(ByteTokenizer(), _messages(("system", "be nice"), ("user", [{"type": "text", "text": "hi"}])))
    assert text == "<|system|>\nbe nice\n<|user|>\nhi\n<|assistant|>\n"


def test_tokenizer_template_gets_plain_dicts_and_system_for_developer():
    seen = {}

    class Tok:
        def apply_chat_template(self, messages, add_generation_prompt=True):
            seen["messages"], seen["agp"] = messages, add_generation_prompt
            return "rendered"

    msgs = _messages(("developer", "rules"), ("user", [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]),
                     ("assistant", None))
    assert render_chat(Tok(), msgs) == "rendered"
    assert seen["agp"] is True
    assert seen["messages"] == [{"role": "system", "content": "rules"}, {"role": "user", "content": "ab"},
                                {"role": "assistant", "content": ""}]


def test_template_errors_are_bad_requests():
    from jinja2 import TemplateError

    class Tok:
        def apply_chat_template(self, messages, add_generation_prompt=True):
            raise TemplateError("Conversation roles must alternate")

    with pytest.raises(APIError) as e:
        render_chat(Tok(), _messages(("user", "x"), ("user", "y")))
    assert e.value.status == 400 and e.value.param == "messages"
    assert "alternate" in e.value.message
