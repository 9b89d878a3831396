"""Many engine requests submitted or aborted as one command (one HTTP request of 1,000 prompts
is one command, not 1,000): all of a batch is added, or none of it."""

from __future__ import annotations

from .llm_engine import LLMEngine
from .outputs import RequestOutput

ADD_SLICE_IDS = 1 << 20   # prompt token ids per add command: pickling 1 M ids holds the GIL ~20 ms


def add_all(engine: LLMEngine, requests: list[tuple]) -> None:
    """``engine.add_request`` for each ``(request_id, prompt, params)``; if one is refused, the
    ones added before it are taken out again (their outputs go nowhere: nobody waits for them)."""
    added = []
    try:
        for request_id, prompt, params in requests:
            engine.add_request(request_id, prompt, params)
            added.append(request_id)
    except Exception:
        for request_id in added:
            engine.abort(request_id)
        raise


def abort_each(engine: LLMEngine, request_ids: list[str]) -> list[RequestOutput]:
    """The final output of each request that was still running."""
    return [out for rid in request_ids if (out := engine.abort(rid)) is not None]


def add_slices(requests: list[tuple]) -> list[list[tuple]]:
    """``requests`` in consecutive slices of at most ADD_SLICE_IDS prompt ids (at least one
    request each), so no single message is slow to pickle."""
    slices, current, ids = [], [], 0
    for req in requests:
        size = len(req[1])
        if current and ids + size > ADD_SLICE_IDS:
            slices.append(current)
            current, ids = [], 0
        current.append(req)
        ids += size
    if current:
        slices.append(current)
    return slices
