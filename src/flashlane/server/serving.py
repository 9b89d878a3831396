"""Pieces both generation endpoints share: engine failures as HTTP errors, usage, SSE endings."""

from __future__ import annotations

import logging
from contextlib import contextmanager

from ..engine.async_engine import EngineDeadError
from .errors import APIError, error_body
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
    except ValueError as exc:  # the engine rejected the request itself
        raise APIError(400, str(exc)) from exc


def stream_error(exc: Exception) -> str:
    """An error that happens after the 200 and the first events went out: one error event,
    then [DONE] (the status can no longer change)."""
    if isinstance(exc, EngineDeadError):
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


def check_not_aborted(finals) -> None:
    """A non-streaming request whose engine request was aborted (the client is still here, so
    the server is shutting down)."""
    if any(o is None or o.finish_reason == "abort" for o in finals):
        raise APIError(503, "the request was aborted: the server is shutting down")
