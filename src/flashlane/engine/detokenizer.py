"""Incremental detokenisation: decode only a small window per new token and never emit half a
UTF-8 character (byte-level BPE splits multi-byte characters across tokens)."""

from __future__ import annotations


class IncrementalDetokenizer:
    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.prefix_offset = 0
        self.read_offset = 0

    def step(self, ids: list[int], final: bool = False) -> str:
        """Text newly readable after ``ids`` grew (``ids`` = all output tokens so far)."""
        prefix = self.tokenizer.decode(ids[self.prefix_offset:self.read_offset])
        full = self.tokenizer.decode(ids[self.prefix_offset:])
        if len(full) > len(prefix) and (final or not full.endswith("\ufffd")):
            self.prefix_offset, self.read_offset = self.read_offset, len(ids)
            return full[len(prefix):]
        return ""

    def reset(self) -> None:
        self.prefix_offset = self.read_offset = 0
