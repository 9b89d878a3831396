"""Issue 13, item 1: an upload too large to serve is refused while it is still arriving, and the
server keeps answering everyone else meanwhile; responses leave without waiting on the client's
delayed ACK (TCP_NODELAY) also on the socket `serve` binds itself.

Loopback only; every loop has a deadline or a count; nothing asserts on durations.
"""

from __future__ import annotations

import json
import socket
import threading
import time

import httpx
import pytest
import uvicorn

from flashlane.cli.serve import bind_socket, listen
from flashlane.server.connections import ConnectionLimits, uvicorn_config

from engine_models import preset
from server_harness import LiveServer

MODEL = "tiny-flash"
LIMIT = 1 << 20          # the test server's body limit
PIECE = b"x" * (64 << 10)


@pytest.fixture(scope="module")
def server():
    with LiveServer(preset(MODEL), MODEL, max_body_bytes=LIMIT) as srv:
        yield srv


def _response_if_complete(data: bytes) -> tuple[int, dict] | None:
    head, sep, body = data.partition(b"\r\n\r\n")
    if not sep:
        return None
    lines = head.split(b"\r\n")
    headers = dict(line.split(b":", 1) for line in lines[1:])
    headers = {k.strip().lower(): v.strip() for k, v in headers.items()}
    length = headers.get(b"content-length")
    if length is None or len(body) < int(length):
        return None
    return int(lines[0].split()[1]), json.loads(body[:int(length)])


def _upload_with_health_between(server, chunked: bool, declared: int = 256 << 20, after: int = 8):
    """Send a body of ``declared`` bytes a piece at a time on a raw socket and, between pieces,
    GET /health on another connection; stop ``after`` pieces past the first complete response
    (or when the server stops reading). Returns (status, JSON body, bytes sent before the
    answer, /health statuses)."""
    health = []
    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as s, \
            httpx.Client(base_url=server.url, timeout=30) as c:
        framing = b"Transfer-Encoding: chunked" if chunked else b"Content-Length: %d" % declared
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
                  + framing + b"\r\n\r\n")
        frame = b"%x\r\n" % len(PIECE) + PIECE + b"\r\n" if chunked else PIECE
        sent, received, answer, answered_at = 0, b"", None, None
        while sent < declared and (answer is None or sent < answered_at + after * len(PIECE)):
            try:
                s.sendall(frame)
            except OSError:  # the server may stop reading once it has answered
                break
            sent += len(PIECE)
            health.append(c.get("/health").status_code)  # by now the server has had time to answer
            if answer is None:
                s.setblocking(False)
                try:
                    while answer is None:
                        more = s.recv(65536)
                        if not more:
                            break
                        received += more
                        answer = _response_if_complete(received)
                except BlockingIOError:
                    pass
                finally:
                    s.settimeout(30)
                if answer is not None:
                    answered_at = sent
        while answer is None:
            more = s.recv(65536)
            assert more, f"connection closed without a complete response after {sent} bytes: {received[:300]!r}"
            received += more
            answer = _response_if_complete(received)
            answered_at = sent
    return (*answer, answered_at, health)


@pytest.mark.parametrize("chunked", [False, True], ids=["content-length", "chunked"])
def test_an_oversized_upload_is_refused_before_it_is_read_while_health_answers(server, chunked):
    status, body, sent, health = _upload_with_health_between(server, chunked)
    assert status == 413, body
    err = body["error"]
    assert err["code"] == "request_too_large" and err["type"] == "invalid_request_error"
    assert f"{LIMIT} bytes" in err["message"]
    # answered while the body was still arriving: from the header when it declares its length,
    # once past the limit when it is chunked (far short of the 256 MiB it would have been)
    assert sent < (64 << 20), sent
    assert len(health) > 8 and set(health) == {200}, health
    # and the server still serves
    ok = httpx.post(server.url + "/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 2},
                    timeout=60)
    assert ok.status_code == 200, ok.text


async def _ok(scope, receive, send):
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})
    await send({"type": "http.response.body", "body": b"ok"})


def test_connections_on_the_socket_serve_binds_send_without_delay():
    """asyncio sets TCP_NODELAY only where a socket's proto is IPPROTO_TCP; `serve`'s own socket
    (proto 0) left every keep-alive response waiting on the client's delayed ACK."""
    sock = bind_socket("127.0.0.1", 0)
    assert sock.proto != socket.IPPROTO_TCP  # what made asyncio skip it
    listen(sock, "127.0.0.1", 0)
    port = sock.getsockname()[1]
    limits = ConnectionLimits(timeout_keep_alive=30)
    server = uvicorn.Server(uvicorn_config(_ok, "127.0.0.1", port, limits, log_level="warning",
                                           lifespan="off"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 30
        while not server.started:
            assert thread.is_alive() and time.monotonic() < deadline, "uvicorn did not start"
            time.sleep(0.02)
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=30) as c:
            assert c.get("/").text == "ok"
            protocols = list(server.server_state.connections)
            assert len(protocols) == 1
            served = protocols[0].transport.get_extra_info("socket")
            assert served.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) != 0
            assert c.get("/").text == "ok"  # the same keep-alive connection still serves
    finally:
        server.should_exit = True
        thread.join(30)
        sock.close()
