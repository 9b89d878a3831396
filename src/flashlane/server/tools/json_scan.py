"""Char-by-char scanners for tool calls written as JSON while they are being generated.

``CallObjectScanner`` reads one ``{"name": ..., "<args key>": {...}}`` object: it learns the
name once its string closes and hands out the raw text of the arguments value as it arrives
(held until the name is known, whichever key comes first). ``CallArrayScanner`` reads a JSON
array of such objects (what ``tool_choice: "required"`` decodes). Neither builds the value:
the arguments text passed on is exactly what the model wrote.
"""

from __future__ import annotations

import json


class ValueEnd:
    """Finds where one JSON value ends. ``push`` says whether a char belongs to the value
    (a scalar ends before the first char that cannot continue it); ``done`` once a string,
    object or array has closed."""

    def __init__(self) -> None:
        self.kind: str | None = None   # "string", "nested" or "scalar"
        self.depth = 0
        self.in_string = False
        self.escaped = False
        self.done = False

    def push(self, ch: str) -> bool:
        if self.kind is None:
            self.kind = "string" if ch == '"' else "nested" if ch in "{[" else "scalar"
            self.in_string = self.kind == "string"
            self.depth = int(self.kind == "nested")
            return True
        if self.kind == "scalar":
            return not (ch in ",}]" or ch.isspace())
        if self.in_string:
            if self.escaped:
                self.escaped = False
            elif ch == "\\":
                self.escaped = True
            elif ch == '"':
                self.in_string = False
                self.done = self.kind == "string"
            return True
        if ch == '"':
            self.in_string = True
        elif ch in "{[":
            self.depth += 1
        elif ch in "}]":
            self.depth -= 1
            self.done = self.depth == 0
        return True


class CallObjectScanner:
    """One call object. After each ``push``: ``name`` (once known) and ``take_arguments()``
    (the arguments text not handed out yet; empty until the name is known). ``failed``: the
    text is not such an object (then nothing more is read)."""

    def __init__(self, args_keys: tuple[str, ...], name_key: str = "name") -> None:
        self.args_keys = args_keys
        self.name_key = name_key
        self.name: str | None = None
        self.failed = False
        self.done = False
        self._stage = "open"     # open, key, colon, value, next
        self._key: str | None = None
        self._reading: ValueEnd | None = None
        self._role = ""          # what the value being read is: key, name, args or skip
        self._raw = ""
        self._args = ""

    def take_arguments(self) -> str:
        if self.name is None:
            return ""
        out, self._args = self._args, ""
        return out

    def push(self, ch: str) -> bool:
        """Reads one char; True when it closed the object."""
        if self.done or self.failed:
            return False
        if self._reading is not None:
            if self._reading.push(ch):
                self._keep(ch)
                if self._reading.done:
                    self._end_value()
                return False
            self._end_value()   # a scalar ended just before ch
        if ch.isspace():
            return False
        stage = self._stage
        if stage == "open" and ch == "{":
            self._stage = "key"
        elif stage in ("key", "next") and ch == "}":
            self.done = True
            return True
        elif stage == "key" and ch == '"':
            self._start("key", ch)
        elif stage == "colon" and ch == ":":
            self._stage = "value"
        elif stage == "value":
            role = ("name" if self._key == self.name_key else "args" if self._key in self.args_keys else "skip")
            self._start(role, ch)
        elif stage == "next" and ch == ",":
            self._stage = "key"
        else:
            self.failed = True
        return False

    def _start(self, role: str, ch: str) -> None:
        self._reading, self._role, self._raw = ValueEnd(), role, ""
        self._reading.push(ch)
        self._keep(ch)

    def _keep(self, ch: str) -> None:
        if self._role == "args":
            self._args += ch
        elif self._role in ("key", "name"):
            self._raw += ch

    def _end_value(self) -> None:
        role, self._reading = self._role, None
        if role in ("key", "name"):
            try:
                text = json.loads(self._raw)
            except json.JSONDecodeError:
                text = None
            if not isinstance(text, str) or (role == "name" and not text):
                self.failed = True
                return
            if role == "key":
                self._key, self._stage = text, "colon"
                return
            self.name = text
        self._stage = "next"


class CallArrayScanner:
    """A JSON array of call objects. ``items``: one scanner per object begun, in order."""

    def __init__(self, args_keys: tuple[str, ...]) -> None:
        self.args_keys = args_keys
        self.items: list[CallObjectScanner] = []
        self.failed = False
        self._stage = "open"   # open, item, in_item, next, done

    def push(self, ch: str) -> None:
        if self.failed or self._stage == "done":
            return
        if self._stage == "in_item":
            item = self.items[-1]
            if item.push(ch):
                self._stage = "next"
            elif item.failed:
                self.failed = True
            return
        if ch.isspace():
            return
        if self._stage == "open" and ch == "[":
            self._stage = "item"
        elif self._stage == "item" and ch == "{":
            self.items.append(CallObjectScanner(self.args_keys))
            self.items[-1].push(ch)
            self._stage = "in_item"
        elif ch == "]" and (self._stage == "next" or (self._stage == "item" and not self.items)):
            self._stage = "done"
        elif self._stage == "next" and ch == ",":
            self._stage = "item"
        else:
            self.failed = True
