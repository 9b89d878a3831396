"""Hermes-style tool calls: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` (Qwen,
Hermes, and what flashlane asks of a template that does not render tools itself).

The arguments are passed on as the model wrote them, fragment by fragment as they arrive.
"""

from __future__ import annotations

from .json_scan import CallObjectScanner
from .markup import TaggedCallParser

ARGS_KEYS = ("arguments", "parameters")


class HermesCallBody:
    def __init__(self) -> None:
        self._scan = CallObjectScanner(ARGS_KEYS)
        self._announced = False

    def feed(self, text: str) -> tuple[str | None, str]:
        for ch in text:
            self._scan.push(ch)
        if self._scan.name is None:
            return None, ""
        name = None if self._announced else self._scan.name
        self._announced = True
        return name, self._scan.take_arguments()

    def close(self, complete: bool) -> tuple[str | None, str] | None:
        if not self._announced:
            return None
        return None, self._scan.take_arguments()


def hermes_parser(max_calls: int | None = None) -> TaggedCallParser:
    return TaggedCallParser(HermesCallBody, max_calls)
