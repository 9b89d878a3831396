"""`flashlane serve` as users run it (a subprocess). What HTTP costs on top of LLM.generate is a
benchmark (benchmarks/http_overhead.py), not a test: it is a duration."""

from __future__ import annotations

import os
import subprocess
import sys

import httpx
import openai
import pytest

from server_harness import free_port, stop_with_sigint, wait_healthy

pytestmark = pytest.mark.slow
MODEL = "tiny-flash"


def test_serve_subprocess_end_to_end():
    port = free_port()
    cmd = [sys.executable, "-m", "flashlane.cli.main", "serve", "--model", MODEL, "--port", str(port),
           "--api-key", "k3y", "--dtype", "float32", "--cache-memory", str(32 << 20), "--max-model-len", "256",
           "--max-queue", "8", "--shutdown-timeout", "2"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        url = f"http://127.0.0.1:{port}"
        wait_healthy(proc, url)
        client = openai.OpenAI(base_url=url + "/v1", api_key="k3y", max_retries=0)
        assert [m.id for m in client.models.list().data] == [MODEL]  # served name defaults to --model
        r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4,
                                           temperature=0, extra_body={"ignore_eos": True})
        assert r.usage.completion_tokens == 4
        assert httpx.get(url + "/v1/models").status_code == 401
    finally:
        out = stop_with_sigint(proc)
    assert proc.returncode == 0, out
    assert f"serving {MODEL}" in out


