"""POST /v1/completions: prompts (text or token ids, one or a batch) x n choices."""

from __future__ import annotations

import time
from contextlib import aclosing

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from .context import ServerContext
from .errors import bad_request
from .jobs import Job, run_jobs
from .logprobs import TokenText, completion_logprobs, new_entries
from .protocol import CompletionRequest
from .serving import Finished, check_stream_not_aborted, generate, stream_error, usage
from .streaming import DONE, sse


def _prompts(prompt) -> list:
    if isinstance(prompt, str):
        return [prompt]
    if isinstance(prompt[0], int):
        return [prompt]
    return list(prompt)


def _want_token_ids(ctx: ServerContext, body: CompletionRequest) -> bool:
    """Token ids in each choice: asked for (vLLM's return_token_ids), or the only output there is."""
    return body.return_token_ids or ctx.tokenizer is None


async def build_jobs(ctx: ServerContext, body: CompletionRequest) -> tuple[list[Job], list[int]]:
    if body.echo:
        raise bad_request("'echo' is not supported", "echo")
    if body.suffix:
        raise bad_request("'suffix' is not supported", "suffix")
    if body.best_of is not None and body.best_of != body.n:
        raise bad_request("'best_of' must equal 'n' (ranking by best_of is not supported)", "best_of")
    prompts = _prompts(body.prompt)
    ctx.check_seqs(len(prompts) * body.n, "prompt" if len(prompts) > 1 else "n")  # before any tokenising
    ids = await ctx.prompts_ids(prompts, "prompt")
    jobs = []
    for pi, p in enumerate(ids):
        for i in range(body.n):
            seed = None if body.seed is None else body.seed + i
            params = ctx.sampling_params(body, len(p), body.max_tokens, body.logprobs, seed, default_max_tokens=16)
            jobs.append(Job(len(jobs), pi, p, params))
    return jobs, [len(p) for p in ids]


async def create_completion(ctx: ServerContext, body: CompletionRequest, request: Request) -> Response:
    done = await generate(ctx, body, request, build_jobs, "cmpl", _stream)
    if not isinstance(done, Finished):
        return done
    rid, jobs, prompt_lens, finals = done.rid, done.jobs, done.prompt_lens, done.finals
    text_of = TokenText(ctx.tokenizer)
    choices = []
    for job, out in zip(jobs, finals):
        lp = None
        if body.logprobs is not None:
            lp = completion_logprobs(text_of, out.token_ids, out.logprobs or [], body.logprobs)
        choices.append({"index": job.index, "text": out.text, "logprobs": lp,
                        "finish_reason": out.finish_reason, "stop_reason": out.stop_reason})
        if _want_token_ids(ctx, body):
            choices[-1]["token_ids"] = list(out.token_ids)
    cached = sum(o.num_cached_tokens for j, o in zip(jobs, finals) if j.index % body.n == 0)
    return JSONResponse({
        "id": rid, "object": "text_completion", "created": int(time.time()), "model": ctx.served_model_name,
        "choices": choices, "usage": usage(prompt_lens, sum(len(o.token_ids) for o in finals), cached),
    })


async def _stream(ctx: ServerContext, rid: str, body: CompletionRequest, jobs: list[Job], prompt_lens: list[int]):
    opts = body.stream_options
    include_usage = bool(opts and opts.include_usage)
    continuous = include_usage and opts.continuous_usage_stats
    text_of = TokenText(ctx.tokenizer)
    want_ids = _want_token_ids(ctx, body)
    created = int(time.time())
    offsets = [0] * len(jobs)
    produced = [0] * len(jobs)
    cached = 0
    try:
        async with aclosing(run_jobs(ctx.engine, rid, jobs, ctx.metrics)) as outs:
            async for job, out in outs:
                check_stream_not_aborted(ctx, rid, out)
                produced[job.index] = len(out.token_ids)
                lp = None
                if body.logprobs is not None:
                    toks, entries = new_entries(out)
                    lp = completion_logprobs(text_of, toks, entries, body.logprobs, offsets[job.index])
                    offsets[job.index] += sum(len(t) for t in lp["tokens"])
                ids = out.delta_token_ids if want_ids else None
                if not (out.delta_text or out.finished or lp or ids or out.delta_token_ids):
                    continue
                if out.finished and job.index % body.n == 0:
                    cached += out.num_cached_tokens
                chunk = {"id": rid, "object": "text_completion", "created": created,
                         "model": ctx.served_model_name,
                         "choices": [{"index": job.index, "text": out.delta_text, "logprobs": lp,
                                      "finish_reason": out.finish_reason if out.finished else None,
                                      "stop_reason": out.stop_reason if out.finished else None}]}
                if want_ids:
                    chunk["choices"][0]["token_ids"] = list(ids)
                if include_usage:
                    chunk["usage"] = usage(prompt_lens, sum(produced), cached) if continuous else None
                yield sse(chunk)
    except Exception as exc:
        yield stream_error(exc)
        return
    if include_usage:
        yield sse({"id": rid, "object": "text_completion", "created": created, "model": ctx.served_model_name,
                   "choices": [], "usage": usage(prompt_lens, sum(produced), cached)})
    yield DONE
