"""The tokenizer over HTTP, in vLLM's shapes: ``POST /tokenize`` (a prompt, or chat messages
through the chat template), ``POST /detokenize`` and ``GET /tokenizer_info`` (what lm-eval's
remote tokenizer reads: the special tokens and the chat template). A server started without a
tokenizer (--skip-tokenizer-init) answers each with a 400."""

from __future__ import annotations

import asyncio
from typing import Annotated

from fastapi import APIRouter
from pydantic import Field

from .chat import message_dicts, render_chat
from .errors import bad_request
from .handler_context import OFFLOAD_CHARS, ServerContext
from .protocol import ChatMessage, TokenId, _Strict

RENDER_INLINE_MESSAGES = 64


class TokenizeRequest(_Strict):
    model: str | None = None
    prompt: str | None = Field(None, description="text to tokenize; exactly one of prompt and messages")
    messages: Annotated[list[ChatMessage], Field(min_length=1)] | None = Field(
        None, description="chat messages, rendered by the chat template first")
    add_special_tokens: bool = Field(
        True, description="add the tokenizer's special tokens (as /v1/completions and /v1/chat/completions do)")
    add_generation_prompt: bool = Field(True, description="messages only: end with the assistant's turn opening")
    return_token_strs: bool = Field(False, description="also return each token's vocabulary string")


class TokenizeResponse(_Strict):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(_Strict):
    model: str | None = None
    tokens: list[TokenId]


class DetokenizeResponse(_Strict):
    prompt: str


def _tokenizer(ctx: ServerContext, param: str | None):
    if ctx.tokenizer is None:
        raise bad_request("this server has no tokenizer (--skip-tokenizer-init)", param)
    return ctx.tokenizer


def _render(tokenizer, messages: list[ChatMessage], add_generation_prompt: bool) -> str:
    if add_generation_prompt:   # exactly what /v1/chat/completions feeds the model
        return render_chat(tokenizer, messages)
    apply = getattr(tokenizer, "apply_chat_template", None)
    if apply is None:
        raise bad_request("this tokenizer has no chat template to render without the generation prompt",
                          "add_generation_prompt")
    try:
        return apply(message_dicts(messages), add_generation_prompt=False)
    except Exception as exc:    # a template error is the messages' fault, as in render_chat
        raise bad_request(f"the chat template cannot render these messages: {exc}", "messages") from exc


async def _tokenize(ctx: ServerContext, body: TokenizeRequest) -> TokenizeResponse:
    ctx.check_model(body.model)
    if (body.prompt is None) == (body.messages is None):
        raise bad_request("give exactly one of 'prompt' and 'messages'", "prompt")
    tokenizer = _tokenizer(ctx, "prompt" if body.messages is None else "messages")
    if body.messages is None:
        text = body.prompt
    else:
        messages, gen = body.messages, body.add_generation_prompt
        text = (_render(tokenizer, messages, gen) if len(messages) <= RENDER_INLINE_MESSAGES
                else await asyncio.to_thread(_render, tokenizer, messages, gen))
    if body.add_special_tokens:   # the generation endpoints' own path (large texts off the loop)
        ids = (await ctx.encode([text]))[0]
    elif len(text) < OFFLOAD_CHARS:
        ids = tokenizer.encode(text, add_special_tokens=False)
    else:
        ids = await asyncio.to_thread(tokenizer.encode, text, add_special_tokens=False)
    strs = [tokenizer.id_to_token(t) or "" for t in ids] if body.return_token_strs else None
    return TokenizeResponse(count=len(ids), max_model_len=ctx.max_model_len, tokens=ids, token_strs=strs)


async def _detokenize(ctx: ServerContext, body: DetokenizeRequest) -> DetokenizeResponse:
    ctx.check_model(body.model)
    tokenizer = _tokenizer(ctx, "tokens")
    vocab = ctx.vocab_size
    bad = next((t for t in body.tokens if t >= vocab), None)
    if bad is not None:
        raise bad_request(f"token id {bad} is outside the vocabulary [0, {vocab})", "tokens")
    return DetokenizeResponse(prompt=tokenizer.decode(body.tokens, skip_special_tokens=False))


def _info(ctx: ServerContext) -> dict:
    tokenizer = _tokenizer(ctx, None)
    return {
        "tokenizer_class": type(tokenizer).__name__,
        "bos_token": getattr(tokenizer, "bos_token", None),
        "eos_token": getattr(tokenizer, "eos_token", None),
        "pad_token": getattr(tokenizer, "pad_token", None),
        "chat_template": getattr(tokenizer, "chat_template", None),
        "model_max_length": ctx.max_model_len,
        "vocab_size": ctx.vocab_size,
    }


def tokenize_router(ctx: ServerContext, errors: dict) -> APIRouter:
    router = APIRouter()

    @router.post("/tokenize", response_model=TokenizeResponse, response_model_exclude_none=True, responses=errors)
    async def tokenize(body: TokenizeRequest):
        return await _tokenize(ctx, body)

    @router.post("/detokenize", response_model=DetokenizeResponse, responses=errors)
    async def detokenize(body: DetokenizeRequest):
        return await _detokenize(ctx, body)

    @router.get("/tokenizer_info", responses=errors)
    async def tokenizer_info():
        return _info(ctx)

    return router
