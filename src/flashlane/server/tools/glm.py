"""GLM-4.5/4.6 tool calls: ``<tool_call>name\\n<arg_key>k</arg_key>\\n<arg_value>v</arg_value>\\n</tool_call>``.

Values are text; each becomes JSON by the parameter's schema: a string parameter keeps the
text as written, anything else is JSON-decoded when it parses (``42``, ``true``, ``[1, 2]``)
and stays a string when it does not. The arguments JSON is streamed one complete pair at a
time (``{"k": v``, ``, "k2": v2``, ``}``), so its fragments join to ``json.dumps`` of the pairs.
"""

from __future__ import annotations

import json
import re
from functools import partial

from .markup import TaggedCallParser

_PAIR = re.compile(r"\s*<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", re.DOTALL)
_NAME_END = re.compile(r"[\n<]")


def _is_string_schema(schema) -> bool:
    if not isinstance(schema, dict):
        return False
    kind = schema.get("type")
    return kind == "string" or (isinstance(kind, list) and [k for k in kind if k != "null"] == ["string"])


def decode_value(text: str, schema) -> object:
    if _is_string_schema(schema):
        return text
    try:
        return json.loads(text.strip())
    except json.JSONDecodeError:
        return text


class GlmCallBody:
    """One block's body; ``params``: tool name -> its parameters' property schemas."""

    def __init__(self, params: dict[str, dict]) -> None:
        self._params = params
        self._text = ""
        self._pos = 0            # where the next pair starts
        self._name: str | None = None
        self._pairs = 0

    def feed(self, text: str) -> tuple[str | None, str]:
        self._text += text
        announced = None
        if self._name is None:
            start = len(self._text) - len(self._text.lstrip())
            end = _NAME_END.search(self._text, start)
            if end is None:
                return None, ""
            self._name = announced = self._text[start:end.start()].strip()
            if not self._name:
                return None, ""
            self._pos = end.start()
        return announced, self._take_pairs()

    def close(self, complete: bool) -> tuple[str | None, str] | None:
        announced = None
        if self._name is None:
            name = self._text.strip()
            if not complete or not name or _NAME_END.search(name):
                return None
            self._name = announced = name
        if not self._name:
            return None
        rest = self._take_pairs()
        return announced, rest + ("}" if self._pairs else "{}")

    def _take_pairs(self) -> str:
        out = []
        props = self._params.get(self._name, {})
        while (m := _PAIR.match(self._text, self._pos)) is not None:
            key = m.group(1).strip()
            value = decode_value(m.group(2), props.get(key))
            pair = f"{json.dumps(key, ensure_ascii=False)}: {json.dumps(value, ensure_ascii=False)}"
            out.append(("{" if self._pairs == 0 else ", ") + pair)
            self._pairs += 1
            self._pos = m.end()
        return "".join(out)


def glm_parser(params: dict[str, dict], max_calls: int | None = None) -> TaggedCallParser:
    return TaggedCallParser(partial(GlmCallBody, params), max_calls)
