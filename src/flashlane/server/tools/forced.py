"""The outputs of a forced tool choice (decoded under ``schema.py``'s grammars) as tool calls.

A named function's output is its arguments object: the call is announced with the first
token and every fragment of text is an arguments fragment (surrounding whitespace dropped).
``"required"``'s output is an array of ``{"name", "parameters"}`` objects, read as it arrives.
Output that is not what the grammar asked for (the engine ran out of tokens first) still
yields the calls read so far; with no call at all, the text is content.
"""

from __future__ import annotations

from .base import CallDelta, ParsedDelta, ToolParser, new_call_id
from .json_scan import CallArrayScanner


class NamedCallParser(ToolParser):
    def __init__(self, name: str) -> None:
        self._name = name
        self._announced = False
        self._begun = False   # the arguments' first non-space char came
        self._space = ""      # whitespace held until more text follows it

    def feed(self, text: str) -> ParsedDelta:
        out = ParsedDelta()
        if not self._announced:
            self._announced = True
            out.calls.append(CallDelta(0, "", self._name, new_call_id()))
        if not self._begun:
            text = text.lstrip()
            self._begun = bool(text)
        body = text.rstrip()
        if body:
            out.add_arguments(CallDelta(0, self._space + body))
            self._space = text[len(body):]
        else:
            self._space += text
        return out

    def finish(self) -> ParsedDelta:
        return self.feed("") if not self._announced else ParsedDelta()


class RequiredCallsParser(ToolParser):
    def __init__(self) -> None:
        self._scan = CallArrayScanner(("parameters",))
        self._announced = 0
        self._text = ""    # kept until the first call is named, in case none ever is

    def feed(self, text: str) -> ParsedDelta:
        out = ParsedDelta()
        if not self._announced:
            self._text += text
        for ch in text:
            self._scan.push(ch)
            self._drain(out)
        return out

    def finish(self) -> ParsedDelta:
        if not self._announced:
            return ParsedDelta(content=self._text)
        return ParsedDelta()

    def _drain(self, out: ParsedDelta) -> None:
        for i, item in enumerate(self._scan.items):
            if item.name is None:
                continue
            if i == self._announced:
                out.calls.append(CallDelta(i, item.take_arguments(), item.name, new_call_id()))
                self._announced += 1
                self._text = ""
            elif i < self._announced:
                out.add_arguments(CallDelta(i, item.take_arguments()))
