"""POST /v1/chat/completions: messages (and tools) rendered by the chat template, n choices.

With tools, each choice's text goes through a tool-call parser (``tools/``): free text with
``tool_choice: "auto"``, grammar-decoded JSON with ``"required"`` or a named function. A stream
sends nothing before a choice's first token: the first chunk of each choice carries the role
together with its first content (or tool-call) delta.
"""

from __future__ import annotations

import asyncio
import time
from contextlib import aclosing

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from ..engine.outputs import RequestOutput
from .chat import render_chat
from .errors import bad_request
from .handler_context import ServerContext
from .jobs import Job, run_jobs
from .logprobs import TokenText, chat_logprobs
from .protocol import ChatCompletionRequest
from .request_params import prompt_ids, sampling_params
from .serving import Finished, check_stream_not_aborted, generate, stream_error, usage
from .streaming import DONE, sse
from .tools import ParsedDelta, ToolPlan, call_format, parse_whole, plan_tools

RENDER_INLINE_MESSAGES = 64


async def build_jobs(ctx: ServerContext, body: ChatCompletionRequest) -> tuple[list[Job], list[int]]:
    if ctx.tokenizer is None:
        raise bad_request("chat completions need a tokenizer and this server has none (--skip-tokenizer-init): "
                          "send token ids to /v1/completions", "messages")
    ctx.check_seqs(body.n, "n")
    plan = plan_tools(body)
    # a long conversation is rendered off the event loop (its size is bounded by the body check)
    text = (render_chat(ctx.tokenizer, body.messages, plan.tools) if len(body.messages) <= RENDER_INLINE_MESSAGES
            else await asyncio.to_thread(render_chat, ctx.tokenizer, body.messages, plan.tools))
    prompt = await prompt_ids(ctx, text, "messages")
    top = body.top_logprobs or 0
    logprobs = top if body.logprobs else None
    max_tokens = body.max_completion_tokens or body.max_tokens  # None: the rest of the context
    structured = plan.structured()
    jobs = []
    for i in range(body.n):
        seed = None if body.seed is None else body.seed + i
        params = sampling_params(ctx, body, len(prompt), max_tokens, logprobs, seed)
        if structured is not None:
            if params.structured is not None:
                raise bad_request(f"tool_choice '{plan.choice}' decodes the calls under a grammar of their own; "
                                  "it cannot be combined with response_format", "tool_choice")
            params.structured = structured
        jobs.append(Job(i, 0, prompt, params))
    return jobs, [len(prompt)]


def finish_reason(out: RequestOutput, called: bool) -> str | None:
    """OpenAI's "tool_calls" for an answer that made calls and ended by itself."""
    return "tool_calls" if called and out.finish_reason == "stop" else out.finish_reason


def answer(plan: ToolPlan, fmt: str, out: RequestOutput) -> tuple[dict, str | None]:
    """A whole choice's message and finish reason."""
    parser = plan.parser(fmt)
    if parser is None:
        return {"role": "assistant", "content": out.text}, out.finish_reason
    content, calls = parse_whole(parser, out.text)
    message = {"role": "assistant", "content": content}
    if calls:
        message["tool_calls"] = calls
    return message, finish_reason(out, bool(calls))


async def create_chat_completion(ctx: ServerContext, body: ChatCompletionRequest, request: Request) -> Response:
    done = await generate(ctx, body, request, build_jobs, "chatcmpl", _stream)
    if not isinstance(done, Finished):
        return done
    rid, jobs, prompt_lens, finals = done.rid, done.jobs, done.prompt_lens, done.finals
    plan, fmt = plan_tools(body), call_format(ctx.tokenizer)
    text_of = TokenText(ctx.tokenizer)
    top = body.top_logprobs or 0
    choices = []
    for job, out in zip(jobs, finals):
        lp = chat_logprobs(text_of, out.token_ids, out.logprobs or [], top) if body.logprobs else None
        message, reason = answer(plan, fmt, out)
        choices.append({"index": job.index, "message": message, "logprobs": lp, "finish_reason": reason,
                        "stop_reason": out.stop_reason})
    return JSONResponse({
        "id": rid, "object": "chat.completion", "created": int(time.time()), "model": ctx.served_model_name,
        "choices": choices,
        "usage": usage(prompt_lens, sum(o.num_output_tokens for o in finals), finals[0].num_cached_tokens),
    })


class _ChoiceStream:
    """One choice's deltas (its outputs hold only what is new): its text through the tool parser,
    the role on its first chunk."""

    def __init__(self, plan: ToolPlan, fmt: str) -> None:
        self.parser = plan.parser(fmt)
        self.started = False
        self.called = False

    def delta(self, out: RequestOutput, must_send: bool) -> dict | None:
        """This output's delta; None when it has nothing to send (and ``must_send`` is false)."""
        if self.parser is None:
            d = {"content": out.text} if out.text or out.token_ids or must_send else None
        else:
            parsed = self.parser.feed(out.text)
            if out.finished:
                parsed.extend(self.parser.finish())
            self.called = self.called or bool(parsed.calls)
            d = _parsed_delta(parsed) if parsed or must_send else None
        if d is not None and not self.started:
            self.started = True
            d = {"role": "assistant", **d}
        return d


def _parsed_delta(parsed: ParsedDelta) -> dict:
    if not parsed.calls:
        return {"content": parsed.content}
    return {"content": parsed.content or None, "tool_calls": [c.as_openai() for c in parsed.calls]}


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
    plan, fmt = plan_tools(body), call_format(ctx.tokenizer)
    choices = [_ChoiceStream(plan, fmt) for _ in jobs]

    def chunk(choice: dict) -> str:
        c = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": ctx.served_model_name,
             "choices": [choice]}
        if include_usage:
            c["usage"] = usage(prompt_lens, sum(produced), cached) if continuous else None
        return sse(c)

    try:
        async with aclosing(run_jobs(ctx.engine, rid, jobs, ctx.metrics)) as outs:
            async for job, out in outs:
                check_stream_not_aborted(ctx, rid, out)
                produced[job.index] = out.num_output_tokens
                lp = None
                if body.logprobs and out.token_ids:
                    lp = chat_logprobs(text_of, out.token_ids, out.logprobs, top)
                choice = choices[job.index]
                delta = choice.delta(out, must_send=out.finished or lp is not None)
                if delta is None:
                    continue
                if out.finished and job.index == 0:
                    cached = out.num_cached_tokens
                finished = out.finished
                yield chunk({"index": job.index, "delta": delta, "logprobs": lp,
                             "finish_reason": finish_reason(out, choice.called) if finished else None,
                             "stop_reason": out.stop_reason if finished else None})
    except Exception as exc:
        yield stream_error(exc)
        return
    if include_usage:
        yield sse({"id": rid, "object": "chat.completion.chunk", "created": created,
                   "model": ctx.served_model_name, "choices": [], "usage": usage(prompt_lens, sum(produced), cached)})
    yield DONE
