"""Calls between ``<tool_call>`` and ``</tool_call>`` tags inside free text (``tool_choice: "auto"``).

Text before the first call is content; once a call opens, its body goes to a format's
``CallBody`` (GLM's arg_key/arg_value tags, Hermes' JSON) and nothing of the markup reaches the
content. A tag split across deltas is held back until it is decided: content that may be the
start of ``<tool_call>`` waits for the next piece. Text after the first call (between or after
calls) is not content, as in vLLM's parsers. A block that turns out not to be a call (no name)
is content when no call came before it.
"""

from __future__ import annotations

from typing import Callable, Protocol

from .base import CallDelta, ParsedDelta, ToolParser, new_call_id

OPEN, CLOSE = "<tool_call>", "</tool_call>"


class CallBody(Protocol):
    def feed(self, text: str) -> tuple[str | None, str]:
        """(the name, on the feed that first knows it; an arguments fragment, once named)."""

    def close(self, complete: bool) -> tuple[str | None, str] | None:
        """The rest at the block's end (``complete``: its closing tag came, rather than the end
        of the text); None when the block was not a call."""


def held_back(text: str, tag: str) -> int:
    """Length of the longest end of ``text`` that is a proper start of ``tag``."""
    for n in range(min(len(text), len(tag) - 1), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


class TaggedCallParser(ToolParser):
    def __init__(self, new_body: Callable[[], CallBody], max_calls: int | None = None) -> None:
        self._new_body = new_body
        self._max_calls = max_calls
        self._pending = ""             # text not decided yet
        self._body: CallBody | None = None
        self._raw = ""                 # the open block's text, in case it is not a call
        self._named = False            # the open block's call has been announced
        self._calls = 0

    def feed(self, text: str) -> ParsedDelta:
        out = ParsedDelta()
        self._pending += text
        while self._pending:
            if self._body is None:
                at = self._pending.find(OPEN)
                if at < 0:
                    keep = held_back(self._pending, OPEN)
                    self._content(out, self._pending[:len(self._pending) - keep])
                    self._pending = self._pending[len(self._pending) - keep:]
                    break
                self._content(out, self._pending[:at])
                self._pending = self._pending[at + len(OPEN):]
                self._body, self._raw, self._named = self._new_body(), OPEN, False
                continue
            at = self._pending.find(CLOSE)
            if at < 0:
                keep = held_back(self._pending, CLOSE)
                self._body_text(out, self._pending[:len(self._pending) - keep])
                self._pending = self._pending[len(self._pending) - keep:]
                break
            self._body_text(out, self._pending[:at])
            self._pending = self._pending[at + len(CLOSE):]
            self._raw += CLOSE
            self._close(out, complete=True)
        return out

    def finish(self) -> ParsedDelta:
        out = ParsedDelta()
        rest, self._pending = self._pending, ""
        if self._body is None:
            self._content(out, rest)
        else:
            self._body_text(out, rest)
            self._close(out, complete=False)
        return out

    # ----
    def _full(self) -> bool:
        return self._max_calls is not None and self._calls >= self._max_calls

    def _content(self, out: ParsedDelta, text: str) -> None:
        if text and self._calls == 0:
            out.content += text

    def _body_text(self, out: ParsedDelta, text: str) -> None:
        if not text:
            return
        self._raw += text
        if not self._full():
            self._emit(out, *self._body.feed(text))

    def _close(self, out: ParsedDelta, complete: bool) -> None:
        body, self._body = self._body, None
        if self._full():
            return
        rest = body.close(complete)
        if not self._named and (rest is None or rest[0] is None):
            self._content(out, self._raw)
            return
        if rest is not None:
            self._emit(out, *rest)
        self._calls += 1

    def _emit(self, out: ParsedDelta, name: str | None, arguments: str) -> None:
        if name is not None:
            self._named = True
            out.calls.append(CallDelta(self._calls, arguments, name, new_call_id()))
        elif self._named:
            out.add_arguments(CallDelta(self._calls, arguments))
