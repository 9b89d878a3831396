"""Incremental detokenisation: decode only a small window per new token and never emit half a
UTF-8 character (byte-level BPE splits multi-byte characters across tokens)."""

from __future__ import annotations


class IncrementalDetokenizer:
    """``skip_special_tokens`` / ``spaces_between_special_tokens``: vLLM's SamplingParams fields
    (see ``Tokenizer.decode``). Without a tokenizer (``skip_tokenizer_init``) there is no text."""

    def __init__(self, tokenizer, skip_special_tokens: bool = True, spaces_between_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.prefix_offset = 0
        self.read_offset = 0
        self._options = {"skip_special_tokens": skip_special_tokens,
                         "spaces_between_special_tokens": spaces_between_special_tokens}

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, **self._options)

    def step(self, ids: list[int], final: bool = False) -> str:
        """Text newly readable after ``ids`` grew (``ids`` = all output tokens so far)."""
        if self.tokenizer is None:
            return ""
        prefix = self._decode(ids[self.prefix_offset:self.read_offset])
        full = self._decode(ids[self.prefix_offset:])
        if len(full) > len(prefix) and (final or not full.endswith("\ufffd")):
            self.prefix_offset, self.read_offset = self.read_offset, len(ids)
            return full[len(prefix):]
        return ""
