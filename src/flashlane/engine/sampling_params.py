"""What a caller asks for one request (vLLM's SamplingParams, the parts flashlane supports)."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field


class OutputKind(enum.Enum):
    """What a request's outputs hold (vLLM's RequestOutputKind): ``DELTA`` only what is new since
    the previous output (streaming), ``CUMULATIVE`` everything so far at every step,
    ``FINAL_ONLY`` one output, at the end, with everything."""

    CUMULATIVE = 0
    DELTA = 1
    FINAL_ONLY = 2


@dataclass(frozen=True)
class StructuredOutput:
    """A constraint on the generated text, enforced token by token by a grammar: exactly one of
    ``json_schema`` (a JSON schema, as a dict or its JSON text) or ``json_object`` (any JSON object)."""

    json_schema: dict | str | None = None
    json_object: bool = False

    def __post_init__(self) -> None:
        if (self.json_schema is not None) == bool(self.json_object):
            raise ValueError("SamplingParams.structured needs exactly one of json_schema or json_object, "
                             f"got json_schema={self.json_schema!r}, json_object={self.json_object!r}")


@dataclass
class SamplingParams:
    max_tokens: int | None = 16          # None: the rest of the context (vLLM's meaning)
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1          # -1 or 0: off
    min_p: float = 0.0
    seed: int | None = None
    stop: list[str] | str | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None          # top-k logprobs per generated token (plus the sampled one)
    prompt_logprobs: int | None = None   # top-k logprobs per prompt token (plus the prompt token)
    skip_special_tokens: bool = True     # drop special tokens from the output text (vLLM)
    spaces_between_special_tokens: bool = True  # a space between added tokens and the text around them (vLLM)
    structured: StructuredOutput | None = None   # the output must follow this grammar (JSON schema / object)
    output_kind: OutputKind = OutputKind.CUMULATIVE   # read by the client side only

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.validate()

    def validate(self) -> None:
        def bad(name: str, why: str):
            raise ValueError(f"SamplingParams.{name} {why}, got {getattr(self, name)!r}")

        if self.max_tokens is not None and (not _is_int(self.max_tokens) or self.max_tokens < 1):
            bad("max_tokens", "must be an integer >= 1 or None")
        if not _is_num(self.temperature) or self.temperature < 0:
            bad("temperature", "must be a number >= 0")
        if not _is_num(self.top_p) or not 0 < self.top_p <= 1:
            bad("top_p", "must be in (0, 1]")
        if not _is_int(self.top_k) or self.top_k < -1:
            bad("top_k", "must be -1 (off), 0 (off) or a positive integer")
        if not _is_num(self.min_p) or not 0 <= self.min_p <= 1:
            bad("min_p", "must be in [0, 1]")
        if self.seed is not None and not _is_int(self.seed):
            bad("seed", "must be an integer or None")
        for name in ("logprobs", "prompt_logprobs"):
            v = getattr(self, name)
            if v is not None and (not _is_int(v) or v < 0):
                bad(name, "must be a non-negative integer or None")
        for name in ("skip_special_tokens", "spaces_between_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                bad(name, "must be True or False")
        if not all(isinstance(s, str) and s for s in self.stop):
            bad("stop", "must be non-empty strings")
        if self.structured is not None and not isinstance(self.structured, StructuredOutput):
            bad("structured", "must be a StructuredOutput or None")
        if not isinstance(self.output_kind, OutputKind):
            bad("output_kind", "must be an OutputKind")
        if not all(_is_int(t) and t >= 0 for t in self.stop_token_ids):
            bad("stop_token_ids", "must be non-negative integers")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)
