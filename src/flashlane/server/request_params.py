"""A request's prompt ids and sampling params, checked before it is admitted.

What depends on the model (vocabulary, context length, what needs a tokenizer) is checked by the
engine's own functions (``engine.request_check``), the ones every add to the engine runs, so the
server and the engine cannot disagree; a refusal becomes a 400 with the engine's param and code.
Around them this module keeps the server's policy: the body limits before tokenising, an
endpoint's default max_tokens, large checks on a worker thread, what OpenAI fields are refused.
"""

from __future__ import annotations

import asyncio

from ..engine.request_check import InvalidRequest, check_prompt_ids, check_sampling, resolve_max_tokens
from ..engine.sampling_params import OutputKind, SamplingParams, StructuredOutput
from ..engine.structured_output import SchemaError, grammar_text
from .body_limits import Refusal, check_text
from .errors import APIError, bad_request, invalid_request
from .handler_context import ServerContext
from .protocol import MAX_LOGPROBS, ResponseFormat

OFFLOAD_IDS = 65_536   # prompts holding at least this many token ids are checked on a worker thread


async def prompt_ids(ctx: ServerContext, prompt: str | list[int], param: str) -> list[int]:
    return (await prompts_ids(ctx, [prompt], param))[0]


async def prompts_ids(ctx: ServerContext, prompts: list, param: str) -> list[list[int]]:
    """Token ids of each prompt (text or ids), checked against the vocabulary and the context;
    a text too long to fit is refused before it is tokenised."""
    texts = [p for p in prompts if isinstance(p, str)]
    if texts and ctx.tokenizer is None:
        raise bad_request("this server has no tokenizer (--skip-tokenizer-init): send the prompt as "
                          "token ids", param)
    if ctx.body_limits is not None:
        for text in texts:
            try:
                check_text(len(text), param, "the prompt", ctx.body_limits)
            except Refusal as r:
                raise APIError(r.status, r.message, r.param, r.code) from None
    encoded = iter(await ctx.encode(texts) if texts else [])
    # the body's own lists, not copies: 1,000 new lists of 15,000 ids are each young-generation
    # collection's work (measured: a 0.12 s collection on the event loop)
    ids = [next(encoded) if isinstance(p, str) else p for p in prompts]
    if sum(map(len, ids)) < OFFLOAD_IDS:
        return _checked(ctx, ids, param)
    return await asyncio.to_thread(_checked, ctx, ids, param)


def _checked(ctx: ServerContext, prompts_ids: list[list[int]], param: str) -> list[list[int]]:
    # one prompt at a time: on a worker thread, the event loop gets the GIL in between
    vocab_size, max_model_len = ctx.vocab_size, ctx.max_model_len
    try:
        for ids in prompts_ids:
            check_prompt_ids(ids, vocab_size, max_model_len, param)
    except InvalidRequest as exc:
        raise invalid_request(exc) from None
    return prompts_ids


def sampling_params(ctx: ServerContext, req, prompt_len: int, max_tokens: int | None, logprobs: int | None,
                    seed: int | None, default_max_tokens: int | None = None) -> SamplingParams:
    """``max_tokens`` None: the server's ``max_tokens_default``, else ``default_max_tokens``, capped
    by the rest of the context (the rest of the context when neither is set). A stream gets its
    outputs as deltas, any other request one final output."""
    for name in ("presence_penalty", "frequency_penalty"):
        if getattr(req, name):
            raise bad_request(f"'{name}' is not supported (only 0)", name)
    if req.logit_bias:  # refused rather than ignored: ignoring it would change what the caller gets
        raise bad_request("'logit_bias' is not supported (only empty or null)", "logit_bias")
    if ctx.max_tokens_default is not None:
        default_max_tokens = ctx.max_tokens_default
    if max_tokens is None and default_max_tokens is not None:   # a default is capped, never refused
        max_tokens = min(default_max_tokens, ctx.max_model_len - prompt_len)
    chat = hasattr(req, "messages")
    param = "max_completion_tokens" if chat and req.max_completion_tokens is not None else "max_tokens"
    if logprobs is not None:
        logprobs = min(logprobs, MAX_LOGPROBS, ctx.vocab_size)
    structured = _constraint(req.response_format)
    try:
        params = SamplingParams(
            max_tokens=resolve_max_tokens(prompt_len, max_tokens, ctx.max_model_len, param,
                                          "messages" if chat else "prompt"),
            temperature=1.0 if req.temperature is None else req.temperature,
            top_p=1.0 if req.top_p is None else req.top_p,
            top_k=-1 if req.top_k is None else req.top_k,
            min_p=0.0 if req.min_p is None else req.min_p,
            seed=seed, stop=req.stop, stop_token_ids=list(req.stop_token_ids or []),
            ignore_eos=req.ignore_eos, logprobs=logprobs, skip_special_tokens=req.skip_special_tokens,
            spaces_between_special_tokens=req.spaces_between_special_tokens, structured=structured,
            output_kind=OutputKind.DELTA if req.stream else OutputKind.FINAL_ONLY,
        )
        check_sampling(params, ctx.tokenizer is not None)
    except InvalidRequest as exc:
        raise invalid_request(exc) from None
    except ValueError as exc:  # SamplingParams names the field: "SamplingParams.<field> ..."
        field = str(exc).split(" ", 1)[0].removeprefix("SamplingParams.")
        raise bad_request(str(exc), field) from exc
    if structured is not None:
        _check_schema(structured)
    return params


def _constraint(fmt: ResponseFormat | None) -> StructuredOutput | None:
    """``response_format`` as the engine's constraint."""
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return StructuredOutput(json_object=True)
    return StructuredOutput(json_schema=fmt.json_schema.schema_)


def _check_schema(structured: StructuredOutput) -> None:
    """The schema is compiled here (well under a millisecond) so that a bad one is a 400 naming
    the field, not a failure inside the engine."""
    try:
        grammar_text(structured)
    except SchemaError as exc:
        raise bad_request(f"'response_format.json_schema.schema' {exc.reason}", "response_format") from None
