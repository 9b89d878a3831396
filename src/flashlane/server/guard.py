"""Reading a generation request's body without stalling the server.

The generation routes read their JSON through ``GuardedRoute``: a body is parsed off the event
loop when it is large, checked against ``BodyLimits`` before the schema validates it, and a very
large body is first checked in a short-lived child process (``python -I -S body_limits.py``), so
that neither parsing it nor refusing it holds this process's GIL or grows its heap. After a large
body the process hands freed heap back to the OS (glibc's ``malloc_trim``; measured: RSS back to
+0 MiB after a refused 30 MB body, +22 MiB without it). ``gc.collect()`` is not needed for that
and would hold the GIL for ~0.1 s, so it is not called.

A large body the child found servable is not checked again here; it is parsed in slices
(``json_slices.py``) and a token-id batch prompt is kept out of the schema validation
(``token_id_prompts.py``): both hold this process's GIL in one piece otherwise (measured: ~1 s
and ~1.8 s for 1,000 prompts of 15,000 ids).
"""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import json
import logging
import subprocess
import sys
import threading
import time
from pathlib import Path

from fastapi import HTTPException
from fastapi.routing import APIRoute
from starlette.datastructures import Headers
from starlette.requests import Request

from . import body_limits
from .body_limits import BodyLimits, Refusal, check_body
from .errors import BodyRefused
from .json_slices import loads_in_slices
from .token_id_prompts import remember, restoring, set_aside

log = logging.getLogger("flashlane.server")

THREAD_BYTES = 64 << 10   # bodies at least this large are parsed on a worker thread
CHILD_BYTES = 1 << 20     # ... and at least this large are first checked in a child process
CHILD_TIMEOUT_S = 120.0
TRIM_BYTES = 1 << 20      # after a body at least this large, memory is given back
_SCRIPT = str(Path(body_limits.__file__).resolve())


def _kind(scope) -> str:
    return "chat" if scope["path"].rstrip("/").endswith("/chat/completions") else "completions"


def _parse_checked(body: bytes, limits: BodyLimits, kind: str, checked: bool = False, loads=json.loads):
    """The parsed body; ``checked``: a child already found it servable (the same bytes give the
    same verdict, so it is not checked again)."""
    data = loads(body)
    if not checked:
        try:
            check_body(data, limits, kind)
        except Refusal as r:
            raise BodyRefused(r) from None
    return data


def _parse_checked_large(body: bytes, limits: BodyLimits, kind: str, checked: bool) -> tuple:
    """For a worker thread, in slices that let the event loop in: the parsed body, with a
    token-id batch prompt set aside (``token_id_prompts.py``), and the prompt set aside."""
    data = _parse_checked(body, limits, kind, checked, loads_in_slices)
    return data, set_aside(data)


def _run_child(body: bytes, limits: BodyLimits, kind: str) -> dict | None:
    try:
        done = subprocess.run([sys.executable, "-I", "-S", _SCRIPT, limits.to_json(), kind], input=body,
                              capture_output=True, timeout=CHILD_TIMEOUT_S, check=False)
        if done.returncode == 0:
            return json.loads(done.stdout)
        log.warning("body check child exited with %s: %s", done.returncode, done.stderr[-500:])
    except (OSError, subprocess.SubprocessError, ValueError) as exc:
        log.warning("body check child failed: %r", exc)
    return None  # the parent checks it itself


async def _check_in_child(body: bytes, limits: BodyLimits, kind: str, slots: asyncio.Semaphore) -> bool:
    """True when the child found the body servable, False when it could not tell."""
    async with slots:
        verdict = await asyncio.to_thread(_run_child, body, limits, kind)
    if verdict is None:
        return False
    if verdict.get("ok"):
        return True
    if "refusal" in verdict:
        raise BodyRefused(Refusal(*verdict["refusal"]))
    if "json_error" in verdict:  # FastAPI turns it into its usual validation error
        msg, pos = verdict["json_error"]
        raise json.JSONDecodeError(msg, "", pos)
    raise HTTPException(400, "There was an error parsing the body")


class GuardedRequest(Request):
    async def body(self) -> bytes:
        """The body copied into one buffer piece by piece as it arrives. Starlette keeps the
        pieces and joins them at the end: one copy of the whole body in a single step that holds
        the GIL (measured: the largest event-loop stall left while a 30 MB body was refused).
        A large body stays a bytearray (``bytes()`` of it would be that same copy again)."""
        if not hasattr(self, "_body"):
            buf = bytearray()
            async for chunk in self.stream():
                buf += chunk
            self._body = bytes(buf) if len(buf) < THREAD_BYTES else buf
        return self._body

    async def json(self):
        if not hasattr(self, "_guarded_json"):
            body = await self.body()
            ctx = self.scope["app"].state.ctx
            limits, kind = ctx.body_limits, _kind(self.scope)
            if limits is None:
                self._guarded_json = json.loads(body)
                return self._guarded_json
            checked = len(body) >= CHILD_BYTES and await _check_in_child(body, limits, kind, ctx.child_slots)
            if len(body) >= THREAD_BYTES:
                self._guarded_json, prompt = await asyncio.to_thread(_parse_checked_large, body, limits, kind,
                                                                     checked)
                remember(prompt)
            else:
                self._guarded_json = _parse_checked(body, limits, kind)
        return self._guarded_json


class GuardedRoute(APIRoute):
    """An APIRoute whose JSON body is read by GuardedRequest (and whose endpoint gets back a
    prompt GuardedRequest kept out of validation)."""

    def __init__(self, path: str, endpoint, **kwargs):
        super().__init__(path, restoring(endpoint), **kwargs)

    def get_route_handler(self):
        handler = super().get_route_handler()

        async def guarded(request: Request):
            return await handler(GuardedRequest(request.scope, request.receive))

        return guarded


# ---- giving memory back -----------------------------------------------------------------------

def _load_malloc_trim():
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        trim = libc.malloc_trim
    except (OSError, AttributeError):  # not glibc
        return None
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    return trim


_malloc_trim = _load_malloc_trim()


class MemoryReleaser:
    """Runs ``malloc_trim(0)`` (which releases the GIL) on a thread, at most one at a time and at
    most once per ``min_interval_s`` (a late request asks for one more run after the current
    one); does nothing where the C library has no malloc_trim."""

    def __init__(self, min_interval_s: float = 1.0):
        self.min_interval_s = min_interval_s
        self._lock = threading.Lock()
        self._running = False
        self._again = False
        self.runs = 0

    def request(self) -> None:
        if _malloc_trim is None:
            return
        with self._lock:
            if self._running:
                self._again = True
                return
            self._running = True
        threading.Thread(target=self._run, name="flashlane-release-memory", daemon=True).start()

    def _run(self) -> None:
        while True:
            _malloc_trim(0)
            self.runs += 1
            time.sleep(self.min_interval_s)
            with self._lock:
                if not self._again:
                    self._running = False
                    return
                self._again = False


class ReleaseMemoryAfterLargeBodies:
    """ASGI middleware: once a request whose body was at least ``min_bytes`` is answered, the
    body (and whatever it was parsed into) is unreferenced; ask for the memory back."""

    def __init__(self, app, releaser: MemoryReleaser, min_bytes: int = TRIM_BYTES):
        self.app, self.releaser, self.min_bytes = app, releaser, min_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        length = Headers(scope=scope).get("content-length")
        seen = int(length) if length is not None and length.isdigit() else 0

        async def counting_receive():
            nonlocal seen
            msg = await receive()
            if msg["type"] == "http.request" and length is None:
                seen += len(msg.get("body", b""))
            return msg

        try:
            await self.app(scope, counting_receive, send)
        finally:
            if seen >= self.min_bytes:
                self.releaser.request()
