"""Connections the server cannot be made to hold forever, and logs that cannot be flooded.

uvicorn's h11 protocol closes a keep-alive connection idle after a response, but it gives a fresh
connection that sends nothing, or a request head or body sent a byte at a time, all the time in
the world, and it has no bound on connections of its own beyond an opt-in plain-text 503. The
protocol here adds to it:

- a fresh connection that sends nothing is closed after ``timeout_keep_alive``, like an idle
  keep-alive one;
- a request head must arrive complete within ``header_timeout`` and its body within
  ``body_timeout`` after that, however slowly the bytes trickle in (408, then close);
- above ``limit_concurrency`` open connections (or requests in flight) a request is answered 503
  in OpenAI's error shape, with ``Connection: close`` and ``Retry-After``.

``rate_limit_noisy_logs`` keeps floods of identical warnings (asyncio's "socket.accept() out of
system resource" when file descriptors run out, bad-request and overload warnings) to one line
per interval, with a count of what was suppressed.
"""

from __future__ import annotations

import json
import logging
import resource
import socket
import threading
import time
from dataclasses import dataclass

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from .errors import error_body

log = logging.getLogger("flashlane.server.connections")

DEFAULT_LIMIT_CONCURRENCY = 1024
_FD_RESERVE = 64  # descriptors kept for the model files, the cache tiers, logs


@dataclass(frozen=True)
class ConnectionLimits:
    timeout_keep_alive: float = 5.0   # s a connection may stay idle (fresh, or between requests)
    header_timeout: float = 10.0      # s for a request head to arrive complete
    body_timeout: float = 60.0        # s for its body to arrive complete, after the head
    limit_concurrency: int | None = DEFAULT_LIMIT_CONCURRENCY  # open connections / requests in flight

    def __post_init__(self):
        for name in ("timeout_keep_alive", "header_timeout", "body_timeout"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0 seconds, got {getattr(self, name)!r}")
        if self.limit_concurrency is not None and self.limit_concurrency < 1:
            raise ValueError(f"limit_concurrency must be >= 1, got {self.limit_concurrency}")


def _raw_response(status: int, reason: bytes, message: str, extra: bytes = b"") -> bytes:
    body = json.dumps(error_body(status, message)).encode()
    return (b"HTTP/1.1 %d %s\r\ncontent-type: application/json\r\ncontent-length: %d\r\nconnection: close\r\n%s\r\n"
            % (status, reason, len(body), extra)) + body


class GuardedH11Protocol(H11Protocol):
    limits = ConnectionLimits()

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._timer = None
        self._phase: str | None = None  # "head" | "body" | None: what is being waited for
        app = self.app

        async def limited(scope, receive, send):
            limit = self.limits.limit_concurrency
            if limit is not None and scope["type"] == "http" and (
                    len(self.connections) > limit or len(self.tasks) > limit):
                log.warning("Refused a request with 503: more than %d connections or requests in flight.", limit)
                body = json.dumps(error_body(503, f"the server is at its connection limit ({limit}); retry "
                                                  "later")).encode()
                await send({"type": "http.response.start", "status": 503,
                            "headers": [(b"content-type", b"application/json"), (b"connection", b"close"),
                                        (b"retry-after", b"1"), (b"content-length", str(len(body)).encode())]})
                await send({"type": "http.response.body", "body": body})
                return
            await app(scope, receive, send)

        self.app = limited

    # ---- protocol events ------------------------------------------------------------------
    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        set_no_delay(transport)
        # uvicorn arms its idle timer only after a first response: a silent socket would stay
        self.timeout_keep_alive_task = self.loop.call_later(self.timeout_keep_alive, self.timeout_keep_alive_handler)
        self._update()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        self._update()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._update()

    def connection_lost(self, exc) -> None:
        self._cancel()
        super().connection_lost(exc)

    # ---- the read deadline ------------------------------------------------------------------
    def _update(self) -> None:
        """Arm the deadline for what the connection now waits for; a deadline already running
        for the same phase is kept (more bytes do not buy more time)."""
        if self.transport is None or self.transport.is_closing():
            return self._cancel()
        state = self.conn.their_state
        want = "head" if state is h11.IDLE else "body" if state is h11.SEND_BODY else None
        if want == self._phase:
            return
        self._cancel()
        if want is not None:
            seconds = self.limits.header_timeout if want == "head" else self.limits.body_timeout
            self._timer = self.loop.call_later(seconds, self._expired, want, seconds)
            self._phase = want

    def _cancel(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._timer, self._phase = None, None

    def _expired(self, phase: str, seconds: float) -> None:
        self._timer, self._phase = None, None
        if self.transport.is_closing():
            return
        message = f"the request {'head' if phase == 'head' else 'body'} did not arrive within {seconds:g} s"
        if phase == "head":
            if self.conn.trailing_data[0]:  # part of a head came: say why before closing
                log.warning("Closed a connection with 408: a request head did not arrive within %g s.", seconds)
                self.transport.write(_raw_response(408, b"Request Timeout", message))
            self.transport.close()
            return
        log.warning("Closed a connection with 408: a request body did not arrive within %g s.", seconds)
        cycle = self.cycle
        if cycle is not None and not cycle.response_started:
            try:
                body = json.dumps(error_body(408, message)).encode()
                out = self.conn.send(h11.Response(status_code=408, reason=b"Request Timeout", headers=[
                    (b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                    (b"connection", b"close")]))
                out += self.conn.send(h11.Data(data=body)) + self.conn.send(h11.EndOfMessage())
                self.transport.write(out)
            except h11.LocalProtocolError:
                pass
        if cycle is not None:  # the app still waiting on receive() sees a disconnect, and its answer goes nowhere
            cycle.disconnected = True
            cycle.message_event.set()
        self.transport.close()


def set_no_delay(transport) -> None:
    """TCP_NODELAY on a connection. asyncio sets it only on sockets whose ``proto`` is
    IPPROTO_TCP, and a socket made by ``socket.socket(AF_INET, SOCK_STREAM)`` (as `serve` binds
    its port before loading the model) has proto 0: each response's head and body then go out as
    two segments, and the second waits for the client's delayed ACK (measured: every keep-alive
    /health took 44 ms instead of 2 ms)."""
    sock = transport.get_extra_info("socket")
    if sock is None or sock.family not in (socket.AF_INET, socket.AF_INET6):
        return
    try:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    except OSError:  # already closed
        pass


def guarded_protocol(limits: ConnectionLimits) -> type[GuardedH11Protocol]:
    return type("GuardedH11Protocol", (GuardedH11Protocol,), {"limits": limits})


def default_limit_concurrency() -> int:
    """DEFAULT_LIMIT_CONCURRENCY, or fewer when the open-file limit would run out first."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return DEFAULT_LIMIT_CONCURRENCY
    return max(1, min(DEFAULT_LIMIT_CONCURRENCY, soft - _FD_RESERVE))


def raise_open_file_limit(target: int = 65536) -> int:
    """Raise the soft RLIMIT_NOFILE towards the hard one (what vLLM does at start); returns it."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = target if hard == resource.RLIM_INFINITY else min(target, hard)
    if soft != resource.RLIM_INFINITY and soft < want:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
            return want
        except (ValueError, OSError):
            pass
    return soft


def uvicorn_config(app, host: str, port: int, limits: ConnectionLimits | None = None, **kw) -> uvicorn.Config:
    """uvicorn's Config with the guarded protocol (and its keep-alive timeout) in place."""
    limits = limits or ConnectionLimits()
    rate_limit_noisy_logs()
    return uvicorn.Config(app, host=host, port=port, http=guarded_protocol(limits),
                          timeout_keep_alive=limits.timeout_keep_alive, **kw)


# ---- logs ---------------------------------------------------------------------------------------

NOISY = ("socket.accept() out of system resource",
         # asyncio schedules an accept retry per failed accept (up to the backlog, each second); the
         # ones still pending when the server closes fail on the closed socket
         "Exception in callback BaseSelectorEventLoop._start_serving",
         "Invalid HTTP request received.", "Exceeded concurrency limit.", "Refused a request with 503",
         "Closed a connection with 408")


class RateLimitFilter(logging.Filter):
    """Lets one record of each noisy kind through per ``interval_s``; the next one let through
    says how many were dropped meanwhile. Other records pass untouched."""

    def __init__(self, interval_s: float = 10.0, prefixes: tuple[str, ...] = NOISY):
        super().__init__()
        self.interval_s, self.prefixes = interval_s, prefixes
        self._last: dict[str, float] = {}
        self._dropped: dict[str, int] = {}
        self._lock = threading.Lock()

    def filter(self, record: logging.LogRecord) -> bool:
        try:
            first = record.getMessage().split("\n", 1)[0]
        except Exception:
            return True
        key = next((p for p in self.prefixes if first.startswith(p)), None)
        if key is None:
            return True
        now = time.monotonic()
        with self._lock:
            last = self._last.get(key)
            if last is not None and now - last < self.interval_s:
                self._dropped[key] = self._dropped.get(key, 0) + 1
                return False
            self._last[key] = now
            dropped = self._dropped.pop(key, 0)
        if dropped:
            record.msg = (f"{record.getMessage()} ({dropped} more like this in the last {self.interval_s:g} s "
                          "suppressed)")
            record.args = ()
        return True


_installed: RateLimitFilter | None = None


def rate_limit_noisy_logs(interval_s: float = 10.0) -> RateLimitFilter:
    """Install one RateLimitFilter on the loggers that can be flooded (idempotent)."""
    global _installed
    if _installed is None:
        _installed = RateLimitFilter(interval_s)
        for name in ("asyncio", "uvicorn.error", log.name):
            logging.getLogger(name).addFilter(_installed)
    return _installed
