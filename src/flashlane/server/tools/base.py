"""What every tool-call parser hands back, and the fold of its deltas into whole calls.

A parser is fed the generated text piece by piece (``feed``) and then told the text is over
(``finish``); each call returns a ``ParsedDelta``: content text for the client, and tool-call
deltas in OpenAI's streaming shape (a call's first delta carries its id and name, later ones
only argument fragments; the fragments of one call concatenate to its arguments JSON). A whole
answer is parsed by the same feed-then-finish, so streamed and non-streamed calls are equal.
"""

from __future__ import annotations

import uuid
from abc import ABC, abstractmethod
from dataclasses import dataclass, field


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass
class CallDelta:
    index: int
    arguments: str = ""
    name: str | None = None   # set (with id) on a call's first delta only
    id: str | None = None

    def as_openai(self) -> dict:
        if self.name is None:
            return {"index": self.index, "function": {"arguments": self.arguments}}
        return {"index": self.index, "id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}


@dataclass
class ParsedDelta:
    content: str = ""
    calls: list[CallDelta] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.content or self.calls)

    def extend(self, other: "ParsedDelta") -> "ParsedDelta":
        self.content += other.content
        for call in other.calls:
            self.add_arguments(call) if call.name is None else self.calls.append(call)
        return self

    def add_arguments(self, call: CallDelta) -> None:
        """An argument fragment, merged into this delta's last fragment of the same call."""
        if not call.arguments:
            return
        if self.calls and self.calls[-1].index == call.index:
            self.calls[-1].arguments += call.arguments
        else:
            self.calls.append(call)


class ToolParser(ABC):
    @abstractmethod
    def feed(self, text: str) -> ParsedDelta: ...

    @abstractmethod
    def finish(self) -> ParsedDelta: ...


class CallFolder:
    """Deltas folded into whole calls (OpenAI's ``message.tool_calls``)."""

    def __init__(self) -> None:
        self.calls: list[dict] = []

    def add(self, delta: ParsedDelta) -> None:
        for c in delta.calls:
            if c.name is not None:
                self.calls.append({"id": c.id, "type": "function",
                                   "function": {"name": c.name, "arguments": c.arguments}})
            else:
                self.calls[c.index]["function"]["arguments"] += c.arguments


def parse_whole(parser: ToolParser, text: str) -> tuple[str | None, list[dict]]:
    """(content, tool_calls) of a whole answer. With calls, content that is only whitespace is
    null (the newline a model writes before its first call is not an answer)."""
    delta = parser.feed(text).extend(parser.finish())
    folder = CallFolder()
    folder.add(delta)
    content = delta.content
    if folder.calls and not content.strip():
        return None, folder.calls
    return content, folder.calls
