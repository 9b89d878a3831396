"""Chat messages -> prompt text through the tokenizer's chat template.

The tokenizer owns the checkpoint's template (and a default for presets without one); a tokenizer
that has no ``apply_chat_template`` at all gets a plain role-tagged layout rendered here. A
template that cannot render the conversation is the caller's fault (400), not a server error.
"""

from __future__ import annotations

from jinja2 import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment

from .errors import bad_request
from .protocol import ChatMessage

FALLBACK_TEMPLATE = (
    "{% for m in messages %}<|{{ m.role }}|>\n{{ m.content }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
_fallback = ImmutableSandboxedEnvironment().from_string(FALLBACK_TEMPLATE)


def message_dicts(messages: list[ChatMessage]) -> list[dict]:
    """Plain dicts for the template; text parts joined (the only part type accepted)."""
    out = []
    for m in messages:
        d = m.model_dump(exclude_none=True)
        if isinstance(m.content, list):
            d["content"] = "".join(p.text for p in m.content)
        d.setdefault("content", "")
        if d["role"] == "developer":  # OpenAI's newer name for the system role; templates know "system"
            d["role"] = "system"
        out.append(d)
    return out


def render_chat(tokenizer, messages: list[ChatMessage]) -> str:
    dicts = message_dicts(messages)
    apply = getattr(tokenizer, "apply_chat_template", None)
    try:
        if apply is None:
            return _fallback.render(messages=dicts, add_generation_prompt=True)
        text = apply(dicts, add_generation_prompt=True)
    except (TemplateError, ValueError, TypeError, KeyError, IndexError) as exc:
        raise bad_request(f"the chat template cannot render these messages: {exc}", "messages") from exc
    if not isinstance(text, str):
        raise TypeError(f"apply_chat_template returned {type(text).__name__}, expected str")
    return text
