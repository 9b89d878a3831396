"""One HTTP request becomes one engine request per (prompt, choice); their outputs are merged
into a single stream of ``(job, RequestOutput)``. Closing the stream aborts every unfinished
engine request (their pages and state slots are freed by the engine at once)."""

from __future__ import annotations

import asyncio
from contextlib import aclosing
from dataclasses import dataclass
from typing import AsyncIterator

from ..engine.outputs import RequestOutput
from ..engine.sampling_params import SamplingParams


@dataclass
class Job:
    index: int             # choice index in the response
    prompt_index: int
    prompt_ids: list[int]
    params: SamplingParams


def _observe(metrics, out: RequestOutput) -> None:
    if out.finished and out.finish_reason != "abort":
        metrics.observe_finished(out.metrics)


async def run_jobs(engine, request_id: str, jobs: list[Job], metrics) -> AsyncIterator[tuple[Job, RequestOutput]]:
    if len(jobs) == 1:
        job = jobs[0]
        async with aclosing(engine.generate(f"{request_id}-0", job.prompt_ids, job.params)) as outs:
            async for out in outs:
                _observe(metrics, out)
                yield job, out
        return

    queue: asyncio.Queue = asyncio.Queue()

    async def pump(job: Job) -> None:
        try:
            async with aclosing(engine.generate(f"{request_id}-{job.index}", job.prompt_ids, job.params)) as outs:
                async for out in outs:
                    queue.put_nowait((job, out))
        except Exception as exc:  # handed to the consumer, which fails the whole request
            queue.put_nowait((job, exc))

    tasks = [asyncio.create_task(pump(j)) for j in jobs]
    left = len(jobs)
    try:
        while left:
            job, item = await queue.get()
            if isinstance(item, Exception):
                raise item
            _observe(metrics, item)
            yield job, item
            if item.finished:
                left -= 1
    finally:
        for t in tasks:
            t.cancel()


async def collect(engine, request_id: str, jobs: list[Job], metrics) -> list[RequestOutput]:
    """The final output of every job, in job order."""
    finals: list[RequestOutput | None] = [None] * len(jobs)
    async with aclosing(run_jobs(engine, request_id, jobs, metrics)) as outs:
        async for job, out in outs:
            if out.finished:
                finals[job.index] = out
    return finals  # type: ignore[return-value]
