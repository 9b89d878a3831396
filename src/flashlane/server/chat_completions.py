"""POST /v1/chat/completions: messages rendered by the chat template, n choices."""

from __future__ import annotations

import asyncio
import time
from contextlib import aclosing

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from .chat import render_chat
from .context import ServerContext
from .errors import bad_request
from .jobs import Job, run_jobs
from .logprobs import TokenText, chat_logprobs, new_entries
from .protocol import ChatCompletionRequest
from .serving import Finished, check_stream_not_aborted, generate, stream_error, usage
from .streaming import DONE, sse

RENDER_INLINE_MESSAGES = 64


async def build_jobs(ctx: ServerContext, body: ChatCompletionRequest) -> tuple[list[Job], list[int]]:
    if ctx.tokenizer is None:
        raise bad_request("chat completions need a tokenizer and this server has none (--skip-tokenizer-init): "
                          "send token ids to /v1/completions", "messages")
    ctx.check_seqs(body.n, "n")
    # a long conversation is rendered off the event loop (its size is bounded by the body check)
    text = (render_chat(ctx.tokenizer, body.messages) if len(body.messages) <= RENDER_INLINE_MESSAGES
            else await asyncio.to_thread(render_chat, ctx.tokenizer, body.messages))
    prompt = await ctx.prompt_ids(text, "messages")
    top = body.top_logprobs or 0
    logprobs = top if body.logprobs else None
    max_tokens = body.max_completion_tokens or body.max_tokens  # None: the rest of the context
    jobs = []
    for i in range(body.n):
        seed = None if body.seed is None else body.seed + i
        jobs.append(Job(i, 0, prompt, ctx.sampling_params(body, len(prompt), max_tokens, logprobs, seed)))
    return jobs, [len(prompt)]


async def create_chat_completion(ctx: ServerContext, body: ChatCompletionRequest, request: Request) -> Response:
    done = await generate(ctx, body, request, build_jobs, "chatcmpl", _stream)
    if not isinstance(done, Finished):
        return done
    rid, jobs, prompt_lens, finals = done.rid, done.jobs, done.prompt_lens, done.finals
    text_of = TokenText(ctx.tokenizer)
    top = body.top_logprobs or 0
    choices = []
    for job, out in zip(jobs, finals):
        lp = chat_logprobs(text_of, out.token_ids, out.logprobs or [], top) if body.logprobs else None
        choices.append({"index": job.index, "message": {"role": "assistant", "content": out.text},
                        "logprobs": lp, "finish_reason": out.finish_reason, "stop_reason": out.stop_reason})
    return JSONResponse({
        "id": rid, "object": "chat.completion", "created": int(time.time()), "model": ctx.served_model_name,
        "choices": choices,
        "usage": usage(prompt_lens, sum(len(o.token_ids) for o in finals), finals[0].num_cached_tokens),
    })


async def _stream(ctx: ServerContext, rid: str, body: ChatCompletionRequest, jobs: list[Job],
                  prompt_lens: list[int]):
    opts = body.stream_options
    include_usage = bool(opts and opts.include_usage)
    continuous = include_usage and opts.continuous_usage_stats
    text_of = TokenText(ctx.tokenizer)
    top = body.top_logprobs or 0
    created = int(time.time())
    produced = [0] * len(jobs)
    cached = 0

    def chunk(choice: dict) -> str:
        c = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": ctx.served_model_name,
             "choices": [choice]}
        if include_usage:
            c["usage"] = usage(prompt_lens, sum(produced), cached) if continuous else None
        return sse(c)

    for job in jobs:
        yield chunk({"index": job.index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                     "finish_reason": None})
    try:
        async with aclosing(run_jobs(ctx.engine, rid, jobs, ctx.metrics)) as outs:
            async for job, out in outs:
                check_stream_not_aborted(ctx, rid, out)
                produced[job.index] = len(out.token_ids)
                lp = None
                if body.logprobs:
                    toks, entries = new_entries(out)
                    lp = chat_logprobs(text_of, toks, entries, top) if toks else None
                if not (out.delta_text or out.finished or lp or out.delta_token_ids):
                    continue
                if out.finished and job.index == 0:
                    cached = out.num_cached_tokens
                yield chunk({"index": job.index, "delta": {"content": out.delta_text}, "logprobs": lp,
                             "finish_reason": out.finish_reason if out.finished else None,
                             "stop_reason": out.stop_reason if out.finished else None})
    except Exception as exc:
        yield stream_error(exc)
        return
    if include_usage:
        yield sse({"id": rid, "object": "chat.completion.chunk", "created": created,
                   "model": ctx.served_model_name, "choices": [], "usage": usage(prompt_lens, sum(produced), cached)})
    yield DONE
