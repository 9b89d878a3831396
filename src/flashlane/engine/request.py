"""A request as the engine tracks it: tokens, progress, sampling state and timings."""

from __future__ import annotations

import enum
import sys
import time
from dataclasses import dataclass, field

import torch

from .sampling_params import SamplingParams


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class RequestMetrics:
    """Engine-side timestamps (time.monotonic seconds) and counters."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    token_times: list[float] = field(default_factory=list)
    finish_time: float | None = None
    num_preemptions: int = 0
    num_draft_tokens: int = 0        # speculative decoding: drafts verified for this request
    num_accepted_tokens: int = 0     # and accepted

    @property
    def ttft(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def e2e(self) -> float | None:
        return None if self.finish_time is None else self.finish_time - self.arrival_time


class Request:
    def __init__(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                 eos_token_ids: tuple[int, ...] = (), arrival_time: float | None = None,
                 max_tokens: int | None = None, grammar=None, keep_prompt_logprob_rows: bool = False):
        """``max_tokens``: the effective output limit, resolved by the engine (``params.max_tokens``,
        or for None the rest of the context); the caller's params are never written to.
        ``grammar``: a GrammarMatcher when ``params.structured``. ``keep_prompt_logprob_rows``:
        ``LLM.score`` wants the full log-prob rows of the prompt positions."""
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.params = params
        if max_tokens is None:
            max_tokens = params.max_tokens if params.max_tokens is not None else sys.maxsize
        self.max_tokens: int = max_tokens
        self.output_token_ids: list[int] = []
        self.status = Status.WAITING
        self.finish_reason: str | None = None
        self.stop_reason: str | int | None = None
        # what it holds in the cache (pages, slot, block keys...) the cache manager keeps by request id
        self.num_computed_tokens = 0          # tokens whose cache rows are written
        self.admitted_at = 0                  # step counter when admitted (for preemption order)
        self.draft_token_ids: list[int] = []  # MTP speculative decoding: drafts for the next step
        self.mtp_position = 0                 # MTP speculative decoding: its layer's cache rows end here
        self.num_cached_tokens: int | None = None   # prompt tokens the prefix cache supplied at first admission
        self.logprobs: list[dict[int, float]] | None = [] if params.logprobs is not None else None
        self.prompt_logprobs: list[dict[int, float] | None] | None = (
            [None] if params.prompt_logprobs is not None else None)
        # LLM.score: the full fp32 log-prob rows of the prompt positions, chunk by chunk (None: not wanted)
        self.prompt_logprob_rows: list[torch.Tensor] | None = [] if keep_prompt_logprob_rows else None
        self.stop_token_ids = set(params.stop_token_ids)
        if not params.ignore_eos:
            self.stop_token_ids.update(eos_token_ids)
        self.grammar = grammar
        self.generator = None
        if params.seed is not None:
            self.generator = torch.Generator().manual_seed(params.seed)
        self.metrics = RequestMetrics(arrival_time if arrival_time is not None else time.monotonic())

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED

    def __repr__(self) -> str:
        return (f"Request({self.request_id!r}, prompt={len(self.prompt_token_ids)}, "
                f"out={len(self.output_token_ids)}, computed={self.num_computed_tokens}, {self.status.value})")
