"""The one check of a request against the engine it goes to: prompt ids, context length, what the
sampling params need. The engine runs it on every add; the server runs the same functions before
admitting a request and maps ``InvalidRequest`` to OpenAI's 400 shape (message, param, code)."""

from __future__ import annotations

from array import array

from .sampling_params import SamplingParams


class InvalidRequest(ValueError):
    def __init__(self, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.message, self.param, self.code = message, param, code


CONTEXT_EXCEEDED = "context_length_exceeded"


def check_prompt_ids(ids: list[int] | array, vocab_size: int, max_model_len: int, param: str = "prompt") -> None:
    if not ids:
        raise InvalidRequest("the prompt is empty", param)
    # ~20 ns an id (an int64 array is integers already); bool and float are refused too
    if not isinstance(ids, array) and not all(type(t) is int for t in ids):
        raise InvalidRequest("prompt token ids must be integers", param)
    if max(ids) >= vocab_size or min(ids) < 0:  # max()/min() run in C; the bad id is looked for only then
        bad = next(t for t in ids if not 0 <= t < vocab_size)
        raise InvalidRequest(f"token id {bad} is outside the vocabulary [0, {vocab_size})", param)
    if len(ids) >= max_model_len:
        raise InvalidRequest(f"the prompt has {len(ids)} tokens; this model's maximum context length is "
                             f"{max_model_len} tokens (prompt plus at least one generated token)", param,
                             CONTEXT_EXCEEDED)


def resolve_max_tokens(prompt_len: int, max_tokens: int | None, max_model_len: int, param: str = "max_tokens",
                       where: str = "prompt") -> int:
    """The output limit: ``max_tokens``, or (None) the rest of the context. More than fits is
    refused, not clamped (OpenAI, vLLM)."""
    fits = max_model_len - prompt_len
    if max_tokens is None:
        return fits
    if max_tokens > fits:
        raise InvalidRequest(f"This model's maximum context length is {max_model_len} tokens. However, you "
                             f"requested {prompt_len + max_tokens} tokens ({prompt_len} in the {where}, "
                             f"{max_tokens} in the completion). Please reduce the length of the {where} or "
                             f"'{param}'.", param, CONTEXT_EXCEEDED)
    return max_tokens


def check_sampling(params: SamplingParams, has_tokenizer: bool) -> None:
    if params.stop and not has_tokenizer:
        raise InvalidRequest("stop strings need a tokenizer and this engine has none (skip_tokenizer_init, or "
                             "a checkpoint without tokenizer.json): use stop_token_ids", "stop")
    if params.structured is not None and not has_tokenizer:
        raise InvalidRequest("structured output needs a tokenizer and this engine has none", "response_format")
