"""One HTTP request becomes one engine request per (prompt, choice); their outputs are merged
into a single stream of ``(job, RequestOutput)``. Many jobs are submitted to the engine together
(``generate_many``). Closing the stream aborts every unfinished engine request (their pages and
state slots are freed by the engine at once).

What each output holds is the job's ``params.output_kind``: a stream's jobs ask for deltas (each
output the new text, tokens and logprobs), any other request's for its final output only."""

from __future__ import annotations

from array import array
from contextlib import aclosing
from dataclasses import dataclass
from typing import AsyncIterator

from ..engine.client import EngineClient
from ..engine.outputs import RequestOutput
from ..engine.sampling_params import SamplingParams


@dataclass
class Job:
    index: int             # choice index in the response
    prompt_index: int
    prompt_ids: list[int] | array   # an int64 array: from a large token-id batch (token_id_prompts.py)
    params: SamplingParams


def _observe(metrics, out: RequestOutput) -> None:
    if out.finished and out.finish_reason != "abort":
        metrics.observe_finished(out.metrics)


async def run_jobs(engine: EngineClient, request_id: str, jobs: list[Job], metrics) -> AsyncIterator[tuple[Job, RequestOutput]]:
    if len(jobs) == 1:
        job = jobs[0]
        async with aclosing(engine.generate(f"{request_id}-0", job.prompt_ids, job.params)) as outs:
            async for out in outs:
                _observe(metrics, out)
                yield job, out
        return

    # one batched submission and one batched abort, not a task and a message per job
    requests = [(f"{request_id}-{job.index}", job.prompt_ids, job.params) for job in jobs]
    async with aclosing(engine.generate_many(requests)) as outs:
        async for i, out in outs:
            _observe(metrics, out)
            yield jobs[i], out


async def collect(engine: EngineClient, request_id: str, jobs: list[Job], metrics) -> list[RequestOutput]:
    """The final output of every job, in job order (jobs whose params ask for ``FINAL_ONLY``
    get nothing else)."""
    finals: list[RequestOutput | None] = [None] * len(jobs)
    async with aclosing(run_jobs(engine, request_id, jobs, metrics)) as outs:
        async for job, out in outs:
            if out.finished:
                finals[job.index] = out
    return finals  # type: ignore[return-value]
