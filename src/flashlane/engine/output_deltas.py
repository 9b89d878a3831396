"""RequestOutputs on the wire between the engine-core process and the HTTP process, as deltas.

A RequestOutput is cumulative (all token ids, the whole text, every logprob and token time so
far), so sending it whole each step costs O(length) per token. The encoder (engine side) sends
only what is new since that request's previous output, plus the prompt once; the decoder (HTTP
side) rebuilds the same cumulative RequestOutput. Every request's last output (finished, an
abort included) is sent, so both sides drop their bookkeeping of it then.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .outputs import RequestOutput
from .request import RequestMetrics


class DeltaEncoder:
    def __init__(self):
        self._sent: dict[str, tuple[int, int]] = {}   # request id -> (logprobs, token times) sent

    def started(self, request_id: str) -> bool:
        """Whether an output of this unfinished request was encoded already."""
        return request_id in self._sent

    def encode(self, out: RequestOutput) -> tuple:
        rid = out.request_id
        first = rid not in self._sent
        n_logprobs, n_times = self._sent.get(rid, (0, 0))
        m = out.metrics
        head = (out.prompt_token_ids, out.prompt, out.prompt_logprobs, m.arrival_time) if first else None
        logprobs = None if out.logprobs is None else out.logprobs[n_logprobs:]
        times = m.token_times[n_times:]
        if out.finished:
            self._sent.pop(rid, None)
        else:
            self._sent[rid] = (n_logprobs + len(logprobs or ()), n_times + len(times))
        return (rid, head, out.delta_text, out.delta_token_ids, logprobs, times, out.finished,
                out.finish_reason, out.stop_reason, out.num_cached_tokens,
                (m.first_scheduled_time, m.first_token_time, m.finish_time, m.num_preemptions))


@dataclass
class _Stream:
    prompt_token_ids: list[int]
    prompt: str | None
    prompt_logprobs: list | None
    metrics: RequestMetrics
    logprobs: list | None = None
    text: str = ""
    token_ids: list[int] = field(default_factory=list)


class DeltaDecoder:
    def __init__(self):
        self._streams: dict[str, _Stream] = {}

    def decode(self, delta: tuple) -> RequestOutput | None:
        """The cumulative output; None for a request this decoder never saw the start of."""
        (rid, head, delta_text, delta_ids, logprobs, times, finished, finish_reason, stop_reason,
         num_cached, (first_scheduled, first_token, finish_time, preemptions)) = delta
        if head is not None:
            prompt_ids, prompt, prompt_logprobs, arrival = head
            self._streams[rid] = _Stream(prompt_ids, prompt, prompt_logprobs, RequestMetrics(arrival),
                                         [] if logprobs is not None else None)
        s = self._streams.pop(rid, None) if finished else self._streams.get(rid)
        if s is None:
            return None
        s.text += delta_text
        s.token_ids.extend(delta_ids)
        if logprobs:
            s.logprobs.extend(logprobs)
        m = s.metrics
        m.token_times.extend(times)
        m.first_scheduled_time, m.first_token_time, m.finish_time = first_scheduled, first_token, finish_time
        m.num_preemptions = preemptions
        return RequestOutput(
            request_id=rid, prompt_token_ids=s.prompt_token_ids, text=s.text, token_ids=list(s.token_ids),
            finished=finished, finish_reason=finish_reason, stop_reason=stop_reason, logprobs=s.logprobs,
            prompt_logprobs=s.prompt_logprobs, delta_text=delta_text, delta_token_ids=list(delta_ids),
            num_cached_tokens=num_cached, metrics=m, prompt=s.prompt)
