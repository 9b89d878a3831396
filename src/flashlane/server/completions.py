"""POST /v1/completions: prompts (text or token ids, one or a batch) x n choices.

``echo`` puts each choice's prompt before its completion, in ``text`` and in ``logprobs`` (the
prompt's logprobs come from the engine's prompt logprobs; the first prompt token has none).
``max_tokens: 0`` with echo scores the prompt without a completion: the engine needs at least one
token, so one is generated and dropped (vLLM does the same). What lm-eval's ``local-completions``
sends for loglikelihoods is exactly this.
"""

from __future__ import annotations

import dataclasses
import time
from contextlib import aclosing

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from .errors import bad_request
from .handler_context import ServerContext
from .jobs import Job, run_jobs
from .logprobs import TokenText, completion_logprobs, prompt_logprobs
from .protocol import CompletionRequest
from .request_params import prompts_ids, sampling_params
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


def _scores_only(body: CompletionRequest) -> bool:
    """``max_tokens: 0``: the prompt and its logprobs, no completion."""
    return body.max_tokens == 0


def _engine_prompt_logprobs(ctx: ServerContext, body: CompletionRequest) -> int | None:
    """Top-k the engine computes per prompt token: for the prompt_logprobs field and, with echo
    and logprobs, for the prompt's part of ``logprobs`` (vLLM's rule). None: no prompt logprobs,
    so the request may read the prefix cache."""
    wanted = [k for k in (body.prompt_logprobs, body.logprobs if body.echo else None) if k is not None]
    return min(max(wanted), ctx.vocab_size) if wanted else None


def _check(body: CompletionRequest) -> None:
    if body.suffix:
        raise bad_request("'suffix' is not supported", "suffix")
    if body.best_of is not None and body.best_of != body.n:
        raise bad_request("'best_of' must equal 'n' (ranking by best_of is not supported)", "best_of")
    if _scores_only(body) and not body.echo:
        raise bad_request("'max_tokens' must be at least 1 (0 is accepted only with echo: the prompt is scored "
                          "and nothing is generated)", "max_tokens")
    if body.prompt_logprobs is not None and body.stream:
        raise bad_request("'prompt_logprobs' is not available when stream is true", "prompt_logprobs")


async def build_jobs(ctx: ServerContext, body: CompletionRequest) -> tuple[list[Job], list[int]]:
    _check(body)
    prompts = _prompts(body.prompt)
    ctx.check_seqs(len(prompts) * body.n, "prompt" if len(prompts) > 1 else "n")  # before any tokenising
    ids = await prompts_ids(ctx, prompts, "prompt")
    max_tokens = 1 if _scores_only(body) else body.max_tokens   # the one token is dropped
    prompt_k = _engine_prompt_logprobs(ctx, body)
    jobs = []
    for pi, p in enumerate(ids):
        for i in range(body.n):
            seed = None if body.seed is None else body.seed + i
            params = sampling_params(ctx, body, len(p), max_tokens, body.logprobs, seed, default_max_tokens=16)
            if prompt_k is not None:
                params = dataclasses.replace(params, prompt_logprobs=prompt_k)
            jobs.append(Job(len(jobs), pi, p, params))
    return jobs, [len(p) for p in ids]


class _Echo:
    """Each prompt's text as echoed: a text prompt as sent, token ids decoded (special tokens kept);
    a server without a tokenizer has no text to echo."""

    def __init__(self, ctx: ServerContext, body: CompletionRequest):
        self._prompts = _prompts(body.prompt)
        self._tokenizer = ctx.tokenizer
        self._texts: dict[int, str] = {}

    def text(self, prompt_index: int) -> str:
        if prompt_index not in self._texts:
            p = self._prompts[prompt_index]
            if isinstance(p, str):
                self._texts[prompt_index] = p
            elif self._tokenizer is None:
                self._texts[prompt_index] = ""
            else:
                self._texts[prompt_index] = self._tokenizer.decode(list(p), skip_special_tokens=False)
        return self._texts[prompt_index]


def _prompt_part(job: Job, out) -> tuple[list[int], list]:
    """The prompt's tokens and their engine logprob entries (None for the first token): on a
    final output, or the first output of a stream."""
    return list(job.prompt_ids), list(out.prompt_logprobs)


async def create_completion(ctx: ServerContext, body: CompletionRequest, request: Request) -> Response:
    done = await generate(ctx, body, request, build_jobs, "cmpl", _stream)
    if not isinstance(done, Finished):
        return done
    rid, jobs, prompt_lens, finals = done.rid, done.jobs, done.prompt_lens, done.finals
    text_of = TokenText(ctx.tokenizer)
    echo = _Echo(ctx, body) if body.echo else None
    scores_only = _scores_only(body)
    choices = []
    for job, out in zip(jobs, finals):
        text, token_ids, entries = out.text, out.token_ids, out.logprobs or []
        finish_reason, stop_reason = out.finish_reason, out.stop_reason
        if scores_only:
            text, token_ids, entries, finish_reason, stop_reason = "", [], [], "length", None
        lp_tokens, lp_entries = token_ids, entries
        if echo is not None:
            text = echo.text(job.prompt_index) + text
            if body.logprobs is not None:
                p_ids, p_entries = _prompt_part(job, out)
                lp_tokens, lp_entries = p_ids + token_ids, p_entries + entries
        lp = None
        if body.logprobs is not None:
            lp = completion_logprobs(text_of, lp_tokens, lp_entries, body.logprobs)
        choice = {"index": job.index, "text": text, "logprobs": lp,
                  "finish_reason": finish_reason, "stop_reason": stop_reason}
        if body.prompt_logprobs is not None:
            choice["prompt_logprobs"] = prompt_logprobs(text_of, job.prompt_ids, out.prompt_logprobs or [],
                                                        body.prompt_logprobs, job.params.prompt_logprobs)
        if _want_token_ids(ctx, body):
            choice["token_ids"] = token_ids
        choices.append(choice)
    cached = sum(o.num_cached_tokens for j, o in zip(jobs, finals) if j.index % body.n == 0)
    completion_tokens = 0 if scores_only else sum(o.num_output_tokens for o in finals)
    return JSONResponse({
        "id": rid, "object": "text_completion", "created": int(time.time()), "model": ctx.served_model_name,
        "choices": choices, "usage": usage(prompt_lens, completion_tokens, cached),
    })


async def _stream(ctx: ServerContext, rid: str, body: CompletionRequest, jobs: list[Job], prompt_lens: list[int]):
    opts = body.stream_options
    include_usage = bool(opts and opts.include_usage)
    continuous = include_usage and opts.continuous_usage_stats
    text_of = TokenText(ctx.tokenizer)
    want_ids = _want_token_ids(ctx, body)
    echo = _Echo(ctx, body) if body.echo else None
    scores_only = _scores_only(body)
    created = int(time.time())
    offsets = [0] * len(jobs)
    produced = [0] * len(jobs)
    echoed = [False] * len(jobs)
    cached = 0
    try:
        async with aclosing(run_jobs(ctx.engine, rid, jobs, ctx.metrics)) as outs:
            async for job, out in outs:
                check_stream_not_aborted(ctx, rid, out)
                # the job's params ask for deltas: the text, tokens and logprobs this output adds
                text, toks = out.text, out.token_ids
                entries = out.logprobs if body.logprobs is not None else None
                finish_reason = out.finish_reason if out.finished else None
                stop_reason = out.stop_reason if out.finished else None
                if scores_only:   # the one generated token is dropped
                    text, toks, entries = "", [], ([] if entries is not None else None)
                    finish_reason, stop_reason = ("length" if out.finished else None), None
                else:
                    produced[job.index] = out.num_output_tokens
                ids = toks if want_ids else None
                lp_tokens, lp_entries = toks, entries
                # the first chunk of each choice carries its prompt (as vLLM streams echo)
                first = echo is not None and not echoed[job.index]
                if first:
                    echoed[job.index] = True
                    text = echo.text(job.prompt_index) + text
                    if entries is not None:
                        p_ids, p_entries = _prompt_part(job, out)
                        lp_tokens, lp_entries = p_ids + toks, p_entries + entries
                lp = None
                if lp_entries is not None:
                    lp = completion_logprobs(text_of, lp_tokens, lp_entries, body.logprobs, offsets[job.index])
                    offsets[job.index] += sum(len(t) for t in lp["tokens"])
                if not (first or text or out.finished or lp_tokens or toks):
                    continue
                if out.finished and job.index % body.n == 0:
                    cached += out.num_cached_tokens
                chunk = {"id": rid, "object": "text_completion", "created": created,
                         "model": ctx.served_model_name,
                         "choices": [{"index": job.index, "text": text, "logprobs": lp,
                                      "finish_reason": finish_reason, "stop_reason": stop_reason}]}
                if want_ids:
                    chunk["choices"][0]["token_ids"] = ids
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
