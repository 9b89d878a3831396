"""Errors in OpenAI's JSON shape: ``{"error": {"message", "type", "param", "code"}}``.

Every failure the server answers (bad input, auth, overload, unknown routes, even an internal
bug) goes out in this shape, so OpenAI clients raise their typed exceptions instead of choking
on an HTML or plain-text body.
"""

from __future__ import annotations

import logging

from fastapi import FastAPI, HTTPException, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..engine.request_check import InvalidRequest
from .protocol import MAX_STOP

log = logging.getLogger("flashlane.server")

ECHO_MAX_CHARS = 160

# (type, code) per status, following what OpenAI's API answers
_KIND = {
    400: ("invalid_request_error", None),
    401: ("invalid_request_error", "invalid_api_key"),
    404: ("invalid_request_error", "not_found"),
    405: ("invalid_request_error", "method_not_allowed"),
    408: ("invalid_request_error", "request_timeout"),
    413: ("invalid_request_error", "request_too_large"),
    415: ("invalid_request_error", "unsupported_media_type"),
    429: ("rate_limit_error", "queue_full"),
    500: ("server_error", "internal_error"),
    503: ("server_error", "service_unavailable"),
}


class APIError(Exception):
    """Raised anywhere in a handler; rendered by the app's exception handler."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers


def _text(s: str | None) -> str | None:
    """Client-supplied text in a message (a model name, a field path) may hold lone surrogates,
    which no JSON encoder writes as UTF-8: shown escaped instead of failing the error itself."""
    return s if s is None or s.isascii() else s.encode("utf-8", "backslashreplace").decode("utf-8")


def clip(s: str) -> str:
    """Client-supplied text quoted in an error (a model name, a field path), at most about
    ``ECHO_MAX_CHARS``: a 2 MB model name must not come back as a 2 MB error body."""
    if len(s) <= ECHO_MAX_CHARS:
        return s
    return f"{s[:ECHO_MAX_CHARS]}... ({len(s)} characters)"


class BodyRefused(HTTPException):
    """A refusal raised while FastAPI reads a request body (FastAPI passes HTTPExceptions through
    unchanged), rendered like an APIError, with its param and code. ``refusal``: a
    ``body_limits.Refusal``."""

    def __init__(self, refusal):
        super().__init__(refusal.status, refusal.message)
        self.refusal = refusal


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict:
    kind, default_code = _KIND.get(status, ("invalid_request_error" if status < 500 else "server_error", None))
    return {"error": {"message": _text(message), "type": kind, "param": _text(param), "code": code or default_code}}


def error_response(status: int, message: str, param: str | None = None, code: str | None = None,
                   headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(error_body(status, message, param, code), status_code=status, headers=headers)


def bad_request(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, param)


def invalid_request(exc: InvalidRequest) -> APIError:
    """The engine's refusal of a request (``engine.request_check``) as its 400, param and code kept."""
    return APIError(400, exc.message, exc.param, exc.code)


def _is_type_tag(part) -> bool:
    """pydantic names union branches in error locations ("str", "list[int]", "ChatMessage")."""
    return isinstance(part, str) and (part in _TYPE_TAGS or "[" in part or "-" in part or part[:1].isupper())


_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "none"}


# what a union field accepts, said once instead of "Input should be a valid string" for one branch
_UNION_FORMS = {
    "prompt": "a non-empty string, a list of strings, a list of token ids (integers >= 0) or a list of such lists",
    "stop": "a non-empty string or a list of at most {max_stop} non-empty strings",
    "messages.N.content": "a string or a list of text parts ({{'type': 'text', 'text': ...}})",
}
# what a list field holds, for "may hold at most N ..."
_ITEMS = {"stop": "strings", "stop_token_ids": "token ids", "messages": "messages"}
_TOKEN_ID_FIELDS = ("prompt", "stop_token_ids")


def _is_type_error(e: dict) -> bool:
    return str(e.get("type", "")).endswith("_type")


def _param(e: dict) -> str | None:
    """The field's path; a dict key in it is client-supplied, so the path is clipped."""
    return clip(".".join(str(p) for p in e.get("loc", ()) if p != "body" and not _is_type_tag(p))) or None


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    errors = exc.errors()
    if not errors:
        return "invalid request", None
    if errors[0].get("type") == "json_invalid":
        first = errors[0]
        return f"request body is not valid JSON: {first.get('ctx', {}).get('error', first.get('msg'))}", None
    # a broken constraint says more than a union branch of the wrong type; among equals the
    # deepest location is the most specific one (union branches fail at several depths)
    first = max(errors, key=lambda e: (not _is_type_error(e), len(e.get("loc", ()))))
    param = _param(first)
    where = f"'{param}'" if param else "request body"
    kind, ctx, given = first.get("type"), first.get("ctx") or {}, first.get("input")
    generic = ".".join("N" if p.isdigit() else p for p in (param or "").split("."))
    if _is_type_error(first):  # no branch of a union took the value: say what the field accepts
        top = (param or "").split(".")[0]
        field = generic if generic in _UNION_FORMS else top if top in _UNION_FORMS else None
        if field is not None:
            param = param if field == generic else top
            return f"'{param}' must be {_UNION_FORMS[field].format(max_stop=MAX_STOP)}", param
    if kind == "too_long" and "max_length" in ctx:
        items = _ITEMS.get(generic, "items")
        got = f", got {len(given)}" if isinstance(given, (list, str, dict)) else ""
        return f"{where} may hold at most {ctx['max_length']} {items}{got}", param
    if kind == "too_short" and ctx.get("min_length") == 1:
        return f"{where} must not be empty", param
    if (kind == "greater_than_equal" and ctx.get("ge") == 0 and isinstance(given, int)
            and generic.split(".")[0] in _TOKEN_ID_FIELDS):
        return f"{where}: token ids are integers >= 0; got the negative token id {given}", param
    return f"{where}: {first.get('msg', 'invalid value')}", param


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError):
        return error_response(exc.status, exc.message, exc.param, exc.code, exc.headers)

    @app.exception_handler(BodyRefused)
    async def _refused(_: Request, exc: BodyRefused):
        r = exc.refusal
        return error_response(r.status, r.message, r.param, r.code)

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError):
        message, param = _validation_message(exc)
        return error_response(400, message, param)

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException):
        message = exc.detail if isinstance(exc.detail, str) else "request failed"
        return error_response(exc.status_code, message, headers=getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def _internal(_: Request, exc: Exception):
        log.exception("unhandled error while serving a request")
        # the app re-raises after this answer and uvicorn then drops the connection: say so, so a
        # keep-alive client opens a new one instead of failing its next request
        return error_response(500, f"internal server error: {type(exc).__name__}", headers={"Connection": "close"})
