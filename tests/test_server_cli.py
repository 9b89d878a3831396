"""`flashlane serve` as users run it (a subprocess), and what HTTP costs on top of LLM.generate."""

from __future__ import annotations

import concurrent.futures
import os
import statistics
import subprocess
import sys
import time

import httpx
import openai
import pytest

from flashlane import LLM, SamplingParams

from engine_models import preset
from server_harness import ENGINE_ARGS, LiveServer, free_port, stop_with_sigint, wait_healthy

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


def _worker_thread():
    """One thread besides the main one, as the server's engine runs on (torch's CPU threading
    differs between the main thread and others; comparing like with like isolates the HTTP cost)."""
    return concurrent.futures.ThreadPoolExecutor(max_workers=1)


def test_http_latency_vs_llm_generate():
    """One short greedy request (8 tokens), median of 7: LLM.generate in-process vs the same
    engine settings behind HTTP (non-streaming and streaming). The three are measured in turn
    within each round, so a machine that gets busier or quieter meanwhile slows all of them."""
    loaded = preset(MODEL)
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    llm = LLM(loaded, **ENGINE_ARGS)

    def offline_once():
        t = time.perf_counter()
        llm.generate("A short request", params)
        return time.perf_counter() - t

    body = {"model": MODEL, "prompt": "A short request", "max_tokens": 8, "temperature": 0, "ignore_eos": True}
    with LiveServer(loaded, MODEL) as srv, httpx.Client(base_url=srv.url, timeout=120) as c, \
            _worker_thread() as worker:
        worker.submit(llm.generate, "warm up", params).result()
        c.post("/v1/completions", json=body)
        offline, plain, streamed = [], [], []
        for _ in range(7):
            offline.append(worker.submit(offline_once).result())
            t = time.perf_counter()
            assert c.post("/v1/completions", json=body).status_code == 200
            plain.append(time.perf_counter() - t)
            t = time.perf_counter()
            with c.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
                for _ in r.iter_lines():
                    pass
            streamed.append(time.perf_counter() - t)
    med = {k: statistics.median(v) * 1000 for k, v in
           (("LLM.generate (worker thread)", offline), ("HTTP", plain), ("HTTP stream", streamed))}
    print("\nsingle short request, median ms: " + ", ".join(f"{k} {v:.1f}" for k, v in med.items()))
    base = med["LLM.generate (worker thread)"]
    # the server adds a thread hop, JSON and a socket: milliseconds, not a multiple of the engine time
    assert med["HTTP"] < 1.5 * base + 50
    assert med["HTTP stream"] < 1.5 * base + 50
