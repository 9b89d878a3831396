"""Chat messages (and tools) -> prompt text through the tokenizer's chat template.

The tokenizer owns the checkpoint's template (and a default for presets without one); a tokenizer
that has no ``apply_chat_template`` at all gets a plain role-tagged layout rendered here. A
template that cannot render the conversation is the caller's fault (400), not a server error.

Tools reach a template that renders them (found by rendering a probe with and without one) as
its ``tools`` variable, with each earlier call's arguments as a dict (what tool-aware templates
index, as in Hugging Face's and vLLM's rendering); for any other template the tool conversation
is rewritten into plain messages, Hermes-style (``tools/prompt.py``).
"""

from __future__ import annotations

import json

from jinja2 import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment

from .errors import bad_request
from .protocol import ChatMessage
from .tools.prompt import with_tools_as_text

FALLBACK_TEMPLATE = (
    "{% for m in messages %}<|{{ m.role }}|>\n{{ m.content }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
_fallback = ImmutableSandboxedEnvironment().from_string(FALLBACK_TEMPLATE)
_PROBE = [{"role": "user", "content": "x"}]
_PROBE_TOOLS = [{"type": "function", "function": {"name": "probe", "description": "probe",
                                                  "parameters": {"type": "object", "properties": {}}}}]
_renders_tools: dict[str, bool] = {}   # template text -> whether it renders ``tools``
_TEMPLATE_ERRORS = (TemplateError, ValueError, TypeError, KeyError, IndexError)


def _arguments(text: str, where: str) -> dict:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise bad_request(f"a tool call's arguments must be a JSON object: {exc}", where) from None
    if not isinstance(value, dict):
        raise bad_request(f"a tool call's arguments must be a JSON object, got {type(value).__name__}", where)
    return value


def message_dicts(messages: list[ChatMessage]) -> list[dict]:
    """Plain dicts for the template; text parts joined (the only part type accepted)."""
    out = []
    for i, m in enumerate(messages):
        d = m.model_dump(exclude_none=True)
        if isinstance(m.content, list):
            d["content"] = "".join(p.text for p in m.content)
        d.setdefault("content", "")
        if d["role"] == "developer":  # OpenAI's newer name for the system role; templates know "system"
            d["role"] = "system"
        if m.tool_calls:
            if m.role != "assistant":
                raise bad_request("only assistant messages carry 'tool_calls'", f"messages.{i}.tool_calls")
            for j, call in enumerate(d["tool_calls"]):
                fn = call["function"]
                fn["arguments"] = _arguments(fn["arguments"], f"messages.{i}.tool_calls.{j}.function.arguments")
        out.append(d)
    return out


def renders_tools(tokenizer) -> bool:
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, str) and template in _renders_tools:
        return _renders_tools[template]
    apply = tokenizer.apply_chat_template
    try:
        found = apply(_PROBE, add_generation_prompt=True, tools=_PROBE_TOOLS) != apply(_PROBE,
                                                                                    add_generation_prompt=True)
    except _TEMPLATE_ERRORS:   # a template (or a tokenizer) that takes no tools
        found = False
    if isinstance(template, str):
        _renders_tools[template] = found
    return found


def render_chat(tokenizer, messages: list[ChatMessage], tools: list[dict] | None = None) -> str:
    dicts = message_dicts(messages)
    apply = getattr(tokenizer, "apply_chat_template", None)
    tool_talk = bool(tools) or any(d.get("tool_calls") for d in dicts)
    native = tool_talk and apply is not None and renders_tools(tokenizer)
    if tool_talk and not native:
        dicts = with_tools_as_text(dicts, tools)
    try:
        if apply is None:
            return _fallback.render(messages=dicts, add_generation_prompt=True)
        text = (apply(dicts, add_generation_prompt=True, tools=tools) if native and tools
                else apply(dicts, add_generation_prompt=True))
    except _TEMPLATE_ERRORS as exc:
        raise bad_request(f"the chat template cannot render these messages: {exc}", "messages") from exc
    if not isinstance(text, str):
        raise TypeError(f"apply_chat_template returned {type(text).__name__}, expected str")
    return text
