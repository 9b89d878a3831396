"""Fixtures for the bench tests: a fake OpenAI-compatible server (fast unit tests of the client)
and a real `flashlane serve --model tiny-flash` subprocess.

`server_url` runs each integration test against both; the real one is started here, or taken
from $FLASHLANE_BENCH_SERVER_URL when set.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from bench_fake_server import FakeServer
from flashlane.bench.server_launch import FLASHLANE_SERVE, ServerProcess, free_port


@pytest.fixture(scope="session")
def fake_server_session():
    srv = FakeServer().start()
    yield srv
    srv.stop()


@pytest.fixture
def fake_server(fake_server_session):
    """The shared fake server, reset to default settings for this test."""
    fake_server_session.reset()
    return fake_server_session


@pytest.fixture(scope="session")
def flashlane_server(tmp_path_factory):
    """Base URL of a real `flashlane serve --model tiny-flash` on 127.0.0.1."""
    url = os.environ.get("FLASHLANE_BENCH_SERVER_URL")
    if url:
        yield url.rstrip("/")
        return
    port = free_port()
    log = Path(tmp_path_factory.mktemp("flashlane_server")) / "server.log"
    srv = ServerProcess(FLASHLANE_SERVE + ["--model", "tiny-flash", "--host", "127.0.0.1",
                                           "--port", str(port)], f"http://127.0.0.1:{port}", log,
                        startup_timeout_s=600)
    srv.start()
    yield srv.base_url
    srv.stop()


@pytest.fixture(params=["fake", "flashlane"])
def server_url(request):
    """URL of the server under test: the fake one, then the real flashlane one."""
    if request.param == "fake":
        return request.getfixturevalue("fake_server").url
    return request.getfixturevalue("flashlane_server")


@pytest.fixture
def is_fake(server_url, request):
    return request.node.callspec.params.get("server_url") == "fake"


def run_cli(args: list[str], timeout: float = 300) -> subprocess.CompletedProcess:
    """`flashlane <args>` via the bench/compare command modules (independent of cli/main.py)."""
    code = ("import argparse, sys\n"
            "from flashlane.cli import bench, compare\n"
            "ap = argparse.ArgumentParser(prog='flashlane'); sub = ap.add_subparsers()\n"
            "bench.add_parser(sub); compare.add_parser(sub)\n"
            "a = ap.parse_args(sys.argv[1:]); sys.exit(a.func(a))\n")
    return subprocess.run([sys.executable, "-c", code] + args, capture_output=True, text=True,
                          timeout=timeout, cwd=Path(__file__).resolve().parent.parent)
