"""What the engine hands back per request (vLLM-like, flattened: one completion per request)."""

from __future__ import annotations

from dataclasses import dataclass, field

from .request import RequestMetrics


@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    text: str
    token_ids: list[int]
    finished: bool
    finish_reason: str | None = None        # "stop", "length", "abort"
    stop_reason: str | int | None = None    # the stop string or token id that ended it
    logprobs: list[dict[int, float]] | None = None
    prompt_logprobs: list[dict[int, float] | None] | None = None
    delta_text: str = ""
    delta_token_ids: list[int] = field(default_factory=list)
    num_cached_tokens: int = 0
    metrics: RequestMetrics | None = None
    prompt: str | None = None

    @property
    def outputs(self) -> list["RequestOutput"]:
        """vLLM-style access: ``out.outputs[0].text``."""
        return [self]
