"""Request and response bodies in OpenAI's shapes (plus vLLM's ``top_k``, ``min_p``,
``ignore_eos``, ``stop_token_ids``).

Requests are validated strictly (no "5" for 5, no true for 1, no NaN), so a wrong type is a 400
naming the field rather than a surprise deep in the engine. Bounds that keep the engine safe
(``logprobs`` <= 20, ``n`` <= 16, 64-bit seeds and top-k) live here too; bounds that depend on
the model (context length, vocabulary) are checked by the handlers.

Fields accepted only at one value (the penalties, ``logit_bias``, ``echo``, ``suffix``) are
refused by the handlers with a message saying so; their JSON schema says the same (``ONLY_*``),
so the OpenAPI document advertises nothing the server refuses.
"""

from __future__ import annotations

import time
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

MAX_N = 16
MAX_LOGPROBS = 20
MAX_STOP = 16
INT64_MAX = 2**63 - 1

NonEmptyStr = Annotated[str, Field(min_length=1)]
TokenId = Annotated[int, Field(ge=0, le=INT64_MAX)]


# JSON-schema keywords for "accepted only as this value" (validation stays in the handlers)
ONLY_ZERO = {"const": 0}
ONLY_EMPTY_OBJECT = {"maxProperties": 0}
ONLY_FALSE = {"const": False}
ONLY_EMPTY_STRING = {"maxLength": 0}


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, allow_inf_nan=False, extra="ignore")


class StreamOptions(_Strict):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class _Sampling(_Strict):
    """Fields shared by completions and chat completions."""

    model: str | None = Field(None, description="served model name; defaults to the only model served")
    max_tokens: int | None = Field(None, ge=1, description="tokens to generate; prompt + max_tokens beyond the "
                                                          "context is a 400 (default: the server's "
                                                          "--max-tokens-default if set, else what fits; "
                                                          "completions: at most 16; never more than fits)")
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1, le=INT64_MAX, description="-1 or 0: off (vLLM extension)")
    min_p: float | None = Field(None, ge=0, le=1, description="vLLM extension")
    seed: int | None = Field(None, ge=-(2**63), le=INT64_MAX)
    stop: NonEmptyStr | Annotated[list[NonEmptyStr], Field(max_length=MAX_STOP)] | None = None
    stop_token_ids: Annotated[list[TokenId], Field(max_length=MAX_STOP)] | None = None
    ignore_eos: bool = Field(False, description="vLLM extension: keep generating past EOS")
    skip_special_tokens: bool = Field(True, description="vLLM extension: drop special tokens from the text")
    spaces_between_special_tokens: bool = Field(
        True, description="vLLM extension: a space between added tokens and the text around them")
    n: int = Field(1, ge=1, le=MAX_N)
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float = Field(0.0, ge=-2, le=2, description="only 0 is supported",
                                    json_schema_extra=ONLY_ZERO)
    frequency_penalty: float = Field(0.0, ge=-2, le=2, description="only 0 is supported",
                                     json_schema_extra=ONLY_ZERO)
    user: str | None = None
    logit_bias: dict[str, float] | None = Field(None, description="not supported (must be empty or null)",
                                                json_schema_extra=ONLY_EMPTY_OBJECT)


class CompletionRequest(_Sampling):
    prompt: (NonEmptyStr | Annotated[list[NonEmptyStr], Field(min_length=1)]
             | Annotated[list[TokenId], Field(min_length=1)]
             | Annotated[list[Annotated[list[TokenId], Field(min_length=1)]], Field(min_length=1)])
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool = Field(False, description="only false is supported", json_schema_extra=ONLY_FALSE)
    best_of: int | None = Field(None, ge=1, le=MAX_N,
                                description="must be null or equal to n (ranking by best_of is not supported); "
                                            "any other value is a 400")
    suffix: str | None = Field(None, description="not supported (must be empty or null)",
                               json_schema_extra=ONLY_EMPTY_STRING)
    return_token_ids: bool = Field(False, description="vLLM extension: each choice also carries its token ids "
                                                      "(always on for a server without a tokenizer)")


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(_Strict):
    model_config = ConfigDict(strict=True, allow_inf_nan=False, extra="allow")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None


class ChatCompletionRequest(_Sampling):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: int | None = Field(None, ge=1, description="OpenAI's newer name for max_tokens")
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)


# ---- responses ---------------------------------------------------------------------------------

class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails = Field(default_factory=PromptTokensDetails)


class CompletionLogprobs(BaseModel):
    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class CompletionChoice(BaseModel):
    index: int
    text: str
    token_ids: list[int] | None = Field(None, description="with return_token_ids, or a server without a tokenizer")
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob] | None = None


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None = None


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: Usage | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "flashlane"
    root: str
    max_model_len: int
    flashlane: dict[str, Any] = Field(default_factory=dict, description="the engine's startup cache report")


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorDetail
