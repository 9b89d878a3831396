"""The client side of a request's outputs: engine deltas in, RequestOutputs out.

The engine core sends token ids (``RequestDelta``); here they are accumulated once per request,
detokenised incrementally and checked for stop strings, as vLLM's front-end output processor
does, so the engine process does no text work. A stop-string hit finishes the output here and is
reported to the caller, which aborts the engine request (with finish reason "stop"); deltas the
engine sends for a request that is no longer here are dropped.

Streamed text cannot be taken back, so a tail that may still grow into a stop string is held
until the next tokens decide it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .detokenizer import IncrementalDetokenizer
from .outputs import RequestDelta, RequestOutput
from .request import RequestMetrics
from .sampling_params import OutputKind, SamplingParams


def stop_prefix_len(text: str, start: int, stops: list[str]) -> int:
    """Length of the longest tail of ``text[start:]`` that is a proper prefix of a stop string."""
    for n in range(min(len(text) - start, max(len(s) for s in stops) - 1), 0, -1):
        tail = text[len(text) - n:]
        if any(s.startswith(tail) for s in stops):
            return n
    return 0


@dataclass
class _State:
    prompt_token_ids: list[int]
    prompt: str | None
    params: SamplingParams
    detok: IncrementalDetokenizer
    metrics: RequestMetrics
    token_ids: list[int] = field(default_factory=list)
    logprobs: list | None = None
    prompt_logprobs: list | None = None
    text: str = ""
    held: str = ""               # text that may begin a stop string: not sent yet
    sent_prompt_logprobs: bool = False


@dataclass
class Processed:
    output: RequestOutput | None   # None: nothing to hand on (FINAL_ONLY before the end)
    stopped: bool = False          # a stop string ended it here: the engine request must be aborted


class OutputProcessor:
    """Not thread-safe: its owner serialises ``add``, ``remove`` and ``process``."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self._states: dict[str, _State] = {}

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._states

    def __len__(self) -> int:
        return len(self._states)

    def add(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
            arrival_time: float, prompt: str | None = None) -> None:
        detok = IncrementalDetokenizer(self.tokenizer, params.skip_special_tokens,
                                       params.spaces_between_special_tokens)
        self._states[request_id] = _State(prompt_token_ids, prompt, params, detok, RequestMetrics(arrival_time),
                                          logprobs=[] if params.logprobs is not None else None)

    def remove(self, request_id: str) -> None:
        self._states.pop(request_id, None)

    def process(self, delta: RequestDelta) -> Processed:
        s = self._states.get(delta.request_id)
        if s is None:
            return Processed(None)
        m = s.metrics
        if delta.first_scheduled_time is not None:
            m.first_scheduled_time = delta.first_scheduled_time
        if delta.prompt_logprobs is not None:
            s.prompt_logprobs = delta.prompt_logprobs
        m.num_preemptions = delta.num_preemptions
        m.num_draft_tokens = delta.num_draft_tokens
        m.num_accepted_tokens = delta.num_accepted_tokens
        new_ids = delta.token_ids
        if new_ids:
            if m.first_token_time is None:
                m.first_token_time = delta.time
            m.token_times.extend([delta.time] * len(new_ids))
            s.token_ids.extend(new_ids)
            if s.logprobs is not None and delta.logprobs:
                s.logprobs.extend(delta.logprobs)
        finish_reason, stop_reason = delta.finish_reason, delta.stop_reason
        new_text, hit = self._text(s, finish_reason is not None, stop_reason)
        if hit is not None:
            finish_reason, stop_reason = "stop", hit
        finished = finish_reason is not None
        if finished:
            m.finish_time = delta.time
            del self._states[delta.request_id]
        return Processed(self._output(delta, s, new_ids, new_text, finish_reason, stop_reason), hit is not None)

    def _text(self, s: _State, final: bool, stop_token: int | None) -> tuple[str, str | None]:
        """The text the new tokens add, and the stop string they completed (if any)."""
        new = s.detok.step(s.token_ids, final=final)
        if stop_token is not None:
            new = ""   # the stop token's own text is not part of the completion (vLLM)
        stops = s.params.stop
        if stops and (new or s.held):
            before = len(s.text)
            text = s.text + s.held + new
            horizon = max(0, before - max(len(x) for x in stops) + 1)
            hits = [(i, x) for x in stops if (i := text.find(x, horizon)) >= 0]
            if hits:
                i, x = min(hits)
                s.text, s.held = text[:i], ""
                return (text[before:i] if i >= before else ""), x
            hold = 0 if final else stop_prefix_len(text, before, stops)
            new, s.held = text[before:len(text) - hold], text[len(text) - hold:]
        s.text += new
        return new, None

    def _output(self, delta: RequestDelta, s: _State, new_ids: list[int], new_text: str,
                finish_reason: str | None, stop_reason) -> RequestOutput | None:
        kind = s.params.output_kind
        finished = finish_reason is not None
        if kind is OutputKind.FINAL_ONLY and not finished:
            return None
        if kind is OutputKind.DELTA:
            text, ids = new_text, list(new_ids)
            logprobs = None if s.logprobs is None else (delta.logprobs or [])
            prompt_logprobs = None if s.sent_prompt_logprobs else s.prompt_logprobs
            s.sent_prompt_logprobs = s.sent_prompt_logprobs or s.prompt_logprobs is not None
        else:
            text, ids, logprobs, prompt_logprobs = s.text, list(s.token_ids), s.logprobs, s.prompt_logprobs
            if not finished and logprobs is not None:
                logprobs = list(logprobs)
        return RequestOutput(
            request_id=delta.request_id, prompt_token_ids=s.prompt_token_ids, text=text, token_ids=ids,
            finished=finished, finish_reason=finish_reason, stop_reason=stop_reason, logprobs=logprobs,
            prompt_logprobs=prompt_logprobs, num_output_tokens=len(s.token_ids),
            num_cached_tokens=delta.num_cached_tokens, metrics=s.metrics, prompt=s.prompt)
