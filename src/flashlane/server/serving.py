"""Pieces both generation endpoints share: engine failures as HTTP errors, usage, SSE endings."""

from __future__ import annotations

import logging
import uuid
from contextlib import contextmanager
from dataclasses import dataclass

from fastapi.responses import Response

from ..engine.errors import EngineDeadError
from ..engine.outputs import RequestOutput
from ..engine.request_check import InvalidRequest
from .disconnect import ClientDisconnected, EventStream, cancel_on_disconnect
from . import refused_fields
from .errors import APIError, bad_request, error_body, invalid_request
from .jobs import Job, collect
from .shutdown import SHUTTING_DOWN
from .streaming import DONE, sse

log = logging.getLogger("flashlane.server")


@contextmanager
def engine_errors():
    """Exceptions from submitting to / stepping the engine, as the right HTTP error."""
    try:
        yield
    except APIError:
        raise
    except EngineDeadError as exc:
        raise APIError(503, f"the engine is not running: {exc}") from exc
    except InvalidRequest as exc:  # the engine refused the request itself
        raise invalid_request(exc) from exc
    except ValueError as exc:
        raise APIError(400, str(exc)) from exc


def stream_error(exc: Exception) -> str:
    """An error that happens after the 200 and the first events went out: one error event,
    then [DONE] (the status can no longer change)."""
    if isinstance(exc, InvalidRequest):
        exc = invalid_request(exc)
    if isinstance(exc, APIError):
        body = error_body(exc.status, exc.message, exc.param, exc.code)
    elif isinstance(exc, EngineDeadError):
        body = error_body(503, f"the engine is not running: {exc}")
    elif isinstance(exc, ValueError):
        body = error_body(400, str(exc))
    else:
        log.exception("stream failed", exc_info=exc)
        body = error_body(500, f"internal server error: {type(exc).__name__}")
    return sse(body) + DONE


def usage(prompt_lens: list[int], completion_tokens: int, cached_tokens: int = 0) -> dict:
    prompt = sum(prompt_lens)
    return {"prompt_tokens": prompt, "completion_tokens": completion_tokens,
            "total_tokens": prompt + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


def check_not_aborted(rid: str, finals) -> None:
    """A non-streaming request whose engine request was aborted (the client is still here, so
    the server is shutting down)."""
    if any(o is None or o.finish_reason == "abort" for o in finals):
        log.warning("%s aborted at the shutdown deadline: answered 503", rid)
        raise APIError(503, SHUTTING_DOWN)


def check_stream_not_aborted(ctx, rid: str, out: RequestOutput) -> None:
    """A stream whose engine request was aborted at the shutdown deadline ends with a 503 error
    event and [DONE] (``stream_error``), not a choice with finish_reason 'abort'."""
    if out.finished and out.finish_reason == "abort" and ctx.admission.closed:
        log.warning("%s aborted at the shutdown deadline: ended its stream with a 503 error event", rid)
        raise APIError(503, SHUTTING_DOWN)


@dataclass
class Finished:
    """A non-streaming generation that ran to the end: one final output per job."""

    rid: str
    jobs: list[Job]
    prompt_lens: list[int]
    finals: list[RequestOutput]


async def generate(ctx, body, request, build_jobs, id_prefix: str, stream) -> Finished | Response:
    """The front half both endpoints share: validate, admit, then stream (``stream(ctx, rid,
    body, jobs, prompt_lens)`` as SSE) or collect every job, aborting if the client leaves."""
    ctx.check_model(body.model)
    refused = refused_fields.check(body)
    if refused is not None:
        raise bad_request(refused[1], refused[0])
    ctx.check_alive()
    jobs, prompt_lens = await build_jobs(ctx, body)
    ticket = ctx.admission.admit(len(jobs))
    rid = f"{id_prefix}-{uuid.uuid4().hex}"
    if body.stream:
        return EventStream(stream(ctx, rid, body, jobs, prompt_lens), ticket.release)
    try:
        with engine_errors():
            finals = await cancel_on_disconnect(request, collect(ctx.engine, rid, jobs, ctx.metrics))
    except ClientDisconnected:
        return Response(status_code=499)
    finally:
        ticket.release()
    check_not_aborted(rid, finals)
    return Finished(rid, jobs, prompt_lens, finals)
