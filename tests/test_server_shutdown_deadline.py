"""Requests still running at the graceful-shutdown deadline (issue 21): a non-streaming one gets
503 in OpenAI's error shape, a stream ends with an error event and [DONE], and each logs one
line, no traceback; through the engine's abort (the normal path) and through uvicorn's own
cancellation (the last resort)."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from contextlib import contextmanager

import httpx
import pytest

from engine_models import preset
from flashlane.server.admission import Admission
from flashlane.server.shutdown import AnswerCancelledAtShutdown
from server_harness import LiveServer, free_port, metric, wait_healthy

MODEL = "tiny-flash"
LONG = {"model": MODEL, "max_tokens": 400, "temperature": 0, "ignore_eos": True}
BODIES = {"/v1/completions": {**LONG, "prompt": "a long one"},
          "/v1/chat/completions": {**LONG, "messages": [{"role": "user", "content": "a long one"}]}}
PER_REQUEST_LINE = "at the shutdown deadline"


@pytest.fixture(scope="module")
def loaded():
    return preset(MODEL)


class InFlight:
    """A long non-streaming request and a long stream, each on its own thread."""

    def __init__(self, url: str, path: str = "/v1/completions"):
        self.url, self.path, self.body = url, path, BODIES[path]
        self.response: httpx.Response | None = None
        self.events: list[str] = []
        self.stream_started = threading.Event()
        self.threads = [threading.Thread(target=self._plain, daemon=True),
                        threading.Thread(target=self._stream, daemon=True)]
        for t in self.threads:
            t.start()

    def _plain(self) -> None:
        self.response = httpx.post(self.url + self.path, json=self.body, timeout=300)

    def _stream(self) -> None:
        with httpx.stream("POST", self.url + self.path, json={**self.body, "stream": True}, timeout=300) as r:
            try:
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        self.events.append(line)
                        self.stream_started.set()
            except httpx.HTTPError:
                pass  # the connection was cut: what arrived so far is what the test checks
        self.stream_started.set()

    def wait_running(self, metrics) -> None:
        """Both requests inside the engine (bounded: fails with a message)."""
        deadline = time.monotonic() + 120
        while True:
            m = metrics()
            running = metric(m, "flashlane:num_requests_running") + metric(m, "flashlane:num_requests_waiting")
            if running >= 2 and self.stream_started.is_set():
                return
            assert time.monotonic() < deadline, f"the two requests did not start (in the engine: {running})"
            time.sleep(0.05)

    def join(self) -> None:
        for t in self.threads:
            t.join(300)
            assert not t.is_alive(), "a request did not end after the shutdown"


def _scrape(url: str):
    def metrics() -> dict[str, float]:
        out = {}
        for line in httpx.get(url + "/metrics", timeout=60).text.splitlines():
            if line and not line.startswith("#"):
                key, value = line.rsplit(" ", 1)
                out[key] = float(value)
        return out
    return metrics


def _check_answers(flight: InFlight) -> None:
    r = flight.response
    assert r is not None
    assert r.status_code == 503, (r.status_code, r.text[:300])
    assert r.headers["content-type"].startswith("application/json")
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["type"] == "server_error" and err["code"] == "service_unavailable"
    assert "shutting down" in err["message"]
    assert flight.events, "the stream sent nothing"
    assert flight.events[-1] == "data: [DONE]", flight.events[-3:]
    last = json.loads(flight.events[-2][len("data: "):])
    assert "error" in last, f"the stream finished before the deadline: {last}"
    assert last["error"]["code"] == "service_unavailable" and "shutting down" in last["error"]["message"]


def _paced(srv: LiveServer) -> None:
    """>= 20 ms a step: 400 steps cannot finish within a 1 s deadline on any machine."""
    real_run = srv.engine.transport.engine.runner.run

    def paced_run(sched):
        time.sleep(0.02)
        return real_run(sched)

    srv.engine.transport.engine.runner.run = paced_run


class Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record):
        self.records.append(record)

    def lines(self) -> list[str]:
        return [r.getMessage() for r in self.records]


@contextmanager
def recorded_logs():
    """The server's and uvicorn's log records (uvicorn's Config resets its loggers' handlers:
    enter this after the server is built)."""
    handler = Records()
    loggers = [logging.getLogger(n) for n in ("flashlane.server", "uvicorn.error")]
    for lg in loggers:
        lg.addHandler(handler)
    try:
        yield handler
    finally:
        for lg in loggers:
            lg.removeHandler(handler)


def _check_logs(records: Records) -> None:
    per_request = [line for line in records.lines() if PER_REQUEST_LINE in line]
    assert len(per_request) == 2, records.lines()
    tracebacks = [r.getMessage() for r in records.records if r.exc_info]
    assert not tracebacks, tracebacks


def _stop_with_requests_in_flight(loaded, path: str = "/v1/completions", abort_reaches_nobody: bool = False):
    """Stop a server (1 s deadline) while requests run; their answers and the log are checked."""
    srv = LiveServer(loaded, MODEL, graceful_s=1.0, transport="thread")   # paced: its runner is patched
    _paced(srv)
    if abort_reaches_nobody:  # the abort at the deadline does nothing: uvicorn cancels the handlers
        srv.engine.abort_all = lambda: None
    with recorded_logs() as records, srv:
        flight = InFlight(srv.url, path)
        flight.wait_running(srv.metrics)
        srv.stop()
        assert not srv.thread.is_alive(), "the server did not stop"
        flight.join()
    _check_answers(flight)
    _check_logs(records)
    return srv


@pytest.mark.parametrize("path", sorted(BODIES))
def test_at_the_deadline_requests_are_aborted_and_answered_503(loaded, path):
    srv = _stop_with_requests_in_flight(loaded, path)
    assert not srv.engine.transport.engine.requests


def test_a_handler_still_running_after_the_grace_is_answered_by_the_middleware(loaded):
    _stop_with_requests_in_flight(loaded, abort_reaches_nobody=True)


@pytest.mark.slow
def test_serve_subprocess_answers_in_flight_requests_at_the_deadline():
    """`flashlane serve` as users run it (engine in its own process), stopped with SIGINT."""
    port = free_port()
    cmd = [sys.executable, "-m", "flashlane.cli.main", "serve", "--model", MODEL, "--port", str(port),
           "--dtype", "float32", "--cache-memory", str(32 << 20), "--max-model-len", "512",
           "--shutdown-timeout", "1"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        url = f"http://127.0.0.1:{port}"
        wait_healthy(proc, url)
        flight = InFlight(url)
        flight.wait_running(_scrape(url))
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=120)
        flight.join()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    if flight.response is not None and flight.response.status_code == 200:
        pytest.fail("the long request finished before the 1 s deadline: this machine is too fast for the test")
    _check_answers(flight)
    assert proc.returncode == 0, out
    assert len([line for line in out.splitlines() if PER_REQUEST_LINE in line]) == 2, out
    assert "Traceback" not in out, out


# ---- the middleware alone -----------------------------------------------------------------------

def _cancelled(start_stream: bool, closed: bool) -> tuple[list[dict], BaseException | None]:
    """Run a handler that never ends under the middleware, cancel it; the messages it sent and
    what escaped."""
    admission = Admission(None)
    sent: list[dict] = []

    async def handler(scope, receive, send):
        if start_stream:
            await send({"type": "http.response.start", "status": 200,
                        "headers": [(b"content-type", b"text/event-stream; charset=utf-8")]})
            await send({"type": "http.response.body", "body": b"data: {}\n\n", "more_body": True})
        await asyncio.Event().wait()

    async def send(message):
        sent.append(message)

    async def receive():
        await asyncio.Event().wait()

    async def main():
        app = AnswerCancelledAtShutdown(handler, admission)
        task = asyncio.create_task(app({"type": "http", "method": "POST", "path": "/v1/completions"},
                                       receive, send))
        for _ in range(100):
            await asyncio.sleep(0)
        admission.closed = closed
        task.cancel()
        try:
            await task
        except BaseException as exc:  # noqa: BLE001 - what escaped is the result
            return exc
        return None

    return sent, asyncio.run(main())


def test_middleware_answers_503_json_when_nothing_was_sent():
    sent, escaped = _cancelled(start_stream=False, closed=True)
    assert escaped is None
    assert sent[0]["status"] == 503
    assert json.loads(sent[1]["body"])["error"]["code"] == "service_unavailable"


def test_middleware_ends_a_started_stream_with_an_error_event_and_done():
    sent, escaped = _cancelled(start_stream=True, closed=True)
    assert escaped is None
    tail = sent[-1]
    assert not tail.get("more_body", False)
    events = [e for e in tail["body"].decode().split("\n\n") if e]
    assert events[-1] == "data: [DONE]"
    assert json.loads(events[-2][len("data: "):])["error"]["code"] == "service_unavailable"


def test_middleware_lets_a_cancellation_outside_shutdown_through():
    _, escaped = _cancelled(start_stream=False, closed=False)
    assert isinstance(escaped, asyncio.CancelledError)
