"""Request and response bodies in OpenAI's shapes (plus vLLM's ``top_k``, ``min_p``,
``ignore_eos``, ``stop_token_ids``).

Requests are validated strictly (no "5" for 5, no true for 1, no NaN), so a wrong type is a 400
naming the field rather than a surprise deep in the engine. Bounds that keep the engine safe
(``logprobs`` <= 20, ``n`` <= 16, 64-bit seeds and top-k) live here too; bounds that depend on
the model (context length, vocabulary) are checked by the handlers.

Fields accepted only at one value (the penalties, ``logit_bias``, ``suffix``) are
refused by the handlers with a message saying so; their JSON schema says the same (``ONLY_*``),
so the OpenAPI document advertises nothing the server refuses.
"""

from __future__ import annotations

import time
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from . import refused_fields

MAX_N = 16
MAX_LOGPROBS = 20
MAX_STOP = 16
INT64_MAX = 2**63 - 1

NonEmptyStr = Annotated[str, Field(min_length=1)]
TokenId = Annotated[int, Field(ge=0, le=INT64_MAX)]


# JSON-schema keywords for "accepted only as this value" (validation stays in the handlers)
ONLY_ZERO = {"const": 0}
ONLY_EMPTY_OBJECT = {"maxProperties": 0}
ONLY_EMPTY_STRING = {"maxLength": 0}


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, allow_inf_nan=False, extra="ignore")


class StreamOptions(_Strict):
    include_usage: bool = False
    continuous_usage_stats: bool = False


# vLLM's and OpenAI's fields that flashlane does not implement: declared so that setting one is a
# 400 naming it (``serving.generate``), not a silent no-op
_SamplingRefused = refused_fields.refusing_model("_SamplingRefused", _Strict, refused_fields.SAMPLING)
_ChatRefused = refused_fields.refusing_model("_ChatRefused", _Strict, refused_fields.CHAT)


class JsonSchemaFormat(_Strict):
    name: Annotated[str, Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")]
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema", description="the JSON schema the output follows")
    strict: bool | None = Field(None, description="accepted; the schema is always enforced")


class ResponseFormat(_Strict):
    """OpenAI's ``response_format``: plain text, any JSON object, or JSON following a schema
    (enforced token by token by a grammar)."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_given(self) -> "ResponseFormat":
        if self.type == "json_schema" and (self.json_schema is None or self.json_schema.schema_ is None):
            raise ValueError("type 'json_schema' needs json_schema.schema, the JSON schema to follow")
        return self


class _Sampling(_SamplingRefused):
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
    response_format: ResponseFormat | None = None


class CompletionRequest(_Sampling):
    prompt: (NonEmptyStr | Annotated[list[NonEmptyStr], Field(min_length=1)]
             | Annotated[list[TokenId], Field(min_length=1)]
             | Annotated[list[Annotated[list[TokenId], Field(min_length=1)]], Field(min_length=1)])
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    max_tokens: int | None = Field(None, ge=0, description="tokens to generate (default 16, never more than fits); "
                                                          "0 only with echo: score the prompt without generating")
    echo: bool = Field(False, description="the prompt comes back before the completion, in text and logprobs "
                                          "(the first prompt token has no logprob)")
    prompt_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS,
                                        description="vLLM extension: per prompt token its logprob plus the top "
                                                    "this many; not with stream")
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


MAX_TOOLS = 128
# OpenAI's rule for function names, plus '.' and ':' (MCP-style "server.tool" names)
FunctionName = Annotated[str, Field(pattern=r"^[A-Za-z0-9_.:\-]{1,64}$")]


class FunctionDefinition(_Strict):
    name: FunctionName
    description: str | None = None
    parameters: dict[str, Any] | None = Field(None, description="a JSON schema of the arguments object")
    strict: bool | None = None


class ChatTool(_Strict):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(_Strict):
    name: FunctionName


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: NamedFunction


class FunctionCall(_Strict):
    name: FunctionName
    arguments: str = Field(description="the arguments object as JSON text")


class ToolCall(_Strict):
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Strict):
    model_config = ConfigDict(strict=True, allow_inf_nan=False, extra="allow")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = Field(None, description="assistant messages: the calls it made")
    tool_call_id: str | None = Field(None, description="tool messages: the call this is the result of")


class ChatCompletionRequest(_Sampling, _ChatRefused):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: int | None = Field(None, ge=1, description="OpenAI's newer name for max_tokens")
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    tools: Annotated[list[ChatTool], Field(max_length=MAX_TOOLS)] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = Field(
        None, description="default: 'auto' with tools, 'none' without; 'required' and a named function are "
                          "decoded under a grammar, so the output is always a valid call")
    parallel_tool_calls: bool = Field(True, description="false: at most one call per answer")


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


class PromptLogprob(BaseModel):
    logprob: float
    rank: int | None = Field(None, description="1 = most likely; null where the engine did not rank the token "
                                               "(a prompt token outside the top prompt_logprobs)")
    decoded_token: str


class CompletionChoice(BaseModel):
    index: int
    text: str
    token_ids: list[int] | None = Field(None, description="with return_token_ids, or a server without a tokenizer")
    logprobs: CompletionLogprobs | None = None
    prompt_logprobs: list[dict[str, PromptLogprob] | None] | None = Field(
        None, description="with prompt_logprobs: per prompt token (null for the first), token id -> its logprob")
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
    content: str | None = Field(None, description="null when the answer is only tool calls")
    tool_calls: list[ToolCall] | None = Field(None, description="with finish_reason 'tool_calls'")


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
