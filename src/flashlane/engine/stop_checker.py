"""A sampled token becomes output: the request's tokens, text and timings grow, and the checks
that end a request run (stop token, length, stop strings).

Streamed text cannot be taken back, so a tail that may still grow into a stop string is held
(``Request.held``) until the next tokens decide it.
"""

from __future__ import annotations

from dataclasses import dataclass

from .detokenizer import IncrementalDetokenizer
from .request import Request


def stop_prefix_len(text: str, start: int, stops: list[str]) -> int:
    """Length of the longest tail of ``text[start:]`` that is a proper prefix of a stop string."""
    for n in range(min(len(text) - start, max(len(s) for s in stops) - 1), 0, -1):
        tail = text[len(text) - n:]
        if any(s.startswith(tail) for s in stops):
            return n
    return 0


@dataclass
class TokenUpdate:
    delta: str                          # text to send now
    finish_reason: str | None = None    # "stop" or "length" when this token ends the request
    stop_reason: str | int | None = None  # the stop string or token id that ended it


class StopChecker:
    """One incremental detokenizer per live request, and the end-of-request checks."""

    def __init__(self, tokenizer, max_model_len: int):
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self._detok: dict[str, IncrementalDetokenizer] = {}

    def add(self, req: Request) -> None:
        self._detok[req.request_id] = IncrementalDetokenizer(self.tokenizer, req.params.skip_special_tokens,
                                                             req.params.spaces_between_special_tokens)

    def remove(self, request_id: str) -> None:
        self._detok.pop(request_id, None)

    def append(self, req: Request, token: int, logprobs, now: float) -> TokenUpdate:
        """Record ``token`` (sampled at ``now``) on ``req`` and say what it adds and whether it ends it."""
        req.output_token_ids.append(token)
        if req.logprobs is not None:
            req.logprobs.append(logprobs)
        if req.metrics.first_token_time is None:
            req.metrics.first_token_time = now
        req.metrics.token_times.append(now)
        reason, stop = None, None
        if token in req.stop_token_ids:
            reason, stop = "stop", token
        elif req.grammar is not None and req.grammar.finished:  # the structured output is complete
            reason = "stop"
        elif len(req.output_token_ids) >= req.max_tokens or req.num_tokens >= self.max_model_len:
            reason = "length"
        delta = self._detok[req.request_id].step(req.output_token_ids, final=reason is not None)
        if token in req.stop_token_ids:
            delta = ""  # the stop token's own text is not part of the completion (vLLM)
        if req.params.stop and (delta or req.held):
            before = len(req.text)
            text = req.text + req.held + delta
            horizon = max(0, before - max(len(s) for s in req.params.stop) + 1)
            hits = [(text.find(s, horizon), s) for s in req.params.stop]
            hits = [(i, s) for i, s in hits if i >= 0]
            if hits:
                i, s = min(hits)
                delta = text[before:i] if i >= before else ""
                req.text, req.held = text[:i], ""
                return TokenUpdate(delta, "stop", s)
            hold = 0 if reason is not None else stop_prefix_len(text, before, req.params.stop)
            delta, req.held = text[before:len(text) - hold], text[len(text) - hold:]
        req.text += delta
        return TokenUpdate(delta, reason, stop)
