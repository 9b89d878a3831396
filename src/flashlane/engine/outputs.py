"""What a request's progress looks like on its way out.

``RequestDelta`` is what the engine core emits after a step, per request that changed: only the
new token ids and their logprobs, timings, and the finish. It carries no text: detokenisation and
stop strings are the client's work (``output_processor.py``), which turns deltas into the
``RequestOutput`` callers see (vLLM-like, one completion per request), accumulating once.
"""

from __future__ import annotations

from dataclasses import dataclass

from .request import RequestMetrics


@dataclass(slots=True)
class RequestDelta:
    request_id: str
    token_ids: list[int]                          # sampled this step (empty for an abort)
    logprobs: list[dict[int, float]] | None       # their entries, when the request asked for logprobs
    time: float                                   # time.monotonic() when they were sampled
    finish_reason: str | None = None              # "stop", "length" or "abort" on the last delta
    stop_reason: int | None = None                # the stop token id that ended it
    num_cached_tokens: int = 0                    # prompt tokens the prefix cache supplied
    num_preemptions: int = 0
    num_draft_tokens: int = 0                     # speculative decoding, so far: drafts verified
    num_accepted_tokens: int = 0                  # and accepted
    first_scheduled_time: float | None = None     # on a request's first delta
    prompt_logprobs: list[dict[int, float] | None] | None = None   # on a request's first delta

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def __reduce__(self):
        # pickled as the class (once per message) and its field values: a slots dataclass would
        # otherwise pickle a {field name: value} dict for every delta of every step
        return RequestDelta, tuple(getattr(self, f) for f in _DELTA_FIELDS)


_DELTA_FIELDS = tuple(RequestDelta.__dataclass_fields__)


@dataclass
class RequestOutput:
    """``token_ids``, ``text`` and ``logprobs`` hold what the request's ``output_kind`` says:
    the new part (DELTA) or all of it (CUMULATIVE, FINAL_ONLY). ``prompt_logprobs`` comes on the
    first output of a DELTA stream and on every cumulative one."""

    request_id: str
    prompt_token_ids: list[int]
    text: str
    token_ids: list[int]
    finished: bool
    finish_reason: str | None = None        # "stop", "length", "abort"
    stop_reason: str | int | None = None    # the stop string or token id that ended it
    logprobs: list[dict[int, float]] | None = None
    prompt_logprobs: list[dict[int, float] | None] | None = None
    num_output_tokens: int = 0              # generated so far, whatever the kind
    num_cached_tokens: int = 0
    metrics: RequestMetrics | None = None
    prompt: str | None = None

    @property
    def outputs(self) -> list["RequestOutput"]:
        """vLLM-style access: ``out.outputs[0].text``."""
        return [self]
