"""Run the flashlane app under a real uvicorn on 127.0.0.1 (a background thread) for tests."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import threading
import time

import httpx

from flashlane.engine.client import EngineClient
from flashlane.engine.launch import engine_in_process, engine_in_thread
from flashlane.presets import PRESETS
from flashlane.server.app import create_app
from flashlane.server.connections import ConnectionLimits, uvicorn_config
from flashlane.server.shutdown import ShutdownDeadlineServer

# small pools: every test server allocates its own cache
ENGINE_ARGS = dict(dtype="float32", cache_memory=48 << 20, max_model_len=512)
# an engine process gets one torch thread, as this process has (conftest.py); a death is final
# unless a test builds its own engine with restarts. It loads the model by name, where
# linear_kernel "auto" may choose another format than the model object a thread engine is given
# (auto leaves an object as loaded): aten keeps the two transports' numbers equal.
PROCESS_ARGS = dict(num_threads=1, max_restarts=0, linear_kernel="aten")


def engine_model(loaded) -> str:
    """What an engine process loads to get the same model as ``loaded``: a preset by its name
    (presets are checkpoints written once from a seed: every load gives the same weights), a
    checkpoint by its path; a name or path is taken as it is."""
    if loaded is None:
        raise ValueError("no model to serve: give one, or engine=...")
    if isinstance(loaded, (str, os.PathLike)):
        return os.fspath(loaded)
    if loaded.name in PRESETS:
        return loaded.name
    if getattr(loaded, "path", None) is not None:
        return os.fspath(loaded.path)
    raise ValueError(f"{loaded.name!r} exists only in this process: an engine process cannot load it "
                     "(pass transport='thread')")


def start_engine(loaded, transport: str = "process", **engine_args) -> EngineClient:
    """An engine client for ``loaded`` with the test defaults (not started: the app starts it).
    ``transport="process"``: an engine process loads the model itself, as `flashlane serve`
    runs it; "thread": the engine runs in this process on ``loaded`` itself."""
    args = {**ENGINE_ARGS, **engine_args}
    if transport == "process":
        return engine_in_process(engine_model(loaded), **{**PROCESS_ARGS, **args})
    if transport == "thread":
        return engine_in_thread(loaded, **args)
    raise ValueError(f"transport must be 'process' or 'thread', got {transport!r}")


def wait_healthy(proc, url: str, timeout: float = 300) -> None:
    """Poll ``url``/health until a subprocess server answers 200 (fail early if it exits)."""
    deadline = time.monotonic() + timeout
    while True:
        assert proc.poll() is None, proc.stdout.read()
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        assert time.monotonic() < deadline, "server did not come up"
        time.sleep(0.25)


def stop_with_sigint(proc, timeout: float = 60) -> str:
    """Ctrl-C a subprocess server and return its output (kill it if it does not exit)."""
    proc.send_signal(signal.SIGINT)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LiveServer:
    def __init__(self, loaded, served_model_name: str = "tiny-flash", api_key: str | None = None,
                 max_queue: int | None = None, max_body_bytes: int | None = None, graceful_s: float = 5.0,
                 connection_limits: ConnectionLimits | None = None, max_seqs_per_request: int | None = None,
                 engine: EngineClient | None = None, max_tokens_default: int | None = None,
                 transport: str = "process", **engine_args):
        """``loaded``: the model (a loaded preset or checkpoint, or its name or path).
        ``engine``: an engine client to serve instead (e.g. one that restarts its engine process).
        ``transport``: where the engine runs, see ``start_engine``; "thread" is for the few tests
        that reach into the engine object (``srv.engine.transport.engine``) or serve a model that
        exists only in memory. ``graceful_s``: the shutdown deadline (`serve --shutdown-timeout`)."""
        self.engine = engine if engine is not None else start_engine(loaded, transport, **engine_args)
        kw = {} if max_body_bytes is None else {"max_body_bytes": max_body_bytes}
        if max_seqs_per_request is not None:
            kw["max_seqs_per_request"] = max_seqs_per_request
        if max_tokens_default is not None:
            kw["max_tokens_default"] = max_tokens_default
        self.app = create_app(self.engine, served_model_name, api_key=api_key, max_queue=max_queue, **kw)
        self.model = served_model_name
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.api_key = api_key
        # the protocol, timeouts and shutdown deadline `flashlane serve` runs with
        config = uvicorn_config(self.app, "127.0.0.1", self.port, connection_limits, log_level="warning",
                                timeout_graceful_shutdown=graceful_s, access_log=False)
        self.server = ShutdownDeadlineServer(config, self.app.state.ctx)
        self.thread = threading.Thread(target=self.server.run, name="uvicorn", daemon=True)

    def __enter__(self) -> "LiveServer":
        self.thread.start()
        deadline = time.monotonic() + 60
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("uvicorn did not start")
            time.sleep(0.02)
        return self

    def stop(self, timeout: float = 60) -> None:
        self.server.should_exit = True
        self.thread.join(timeout)

    def __exit__(self, *exc) -> None:
        self.stop()

    @property
    def headers(self) -> dict:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def client(self, **kw) -> httpx.Client:
        return httpx.Client(base_url=self.url, headers=self.headers, timeout=300, **kw)

    def metrics(self) -> dict[str, float]:
        """Scrape /metrics into {'name{labels}': value} (labels kept as written)."""
        text = httpx.get(self.url + "/metrics", headers=self.headers, timeout=60).text
        out = {}
        for line in text.splitlines():
            if line and not line.startswith("#"):
                key, value = line.rsplit(" ", 1)
                out[key] = float(value)
        return out

    def gauge(self, name: str) -> float:
        return metric(self.metrics(), name)

    def wait_idle(self, timeout: float = 30.0) -> dict[str, float]:
        """Poll /metrics until nothing runs or waits and no page or slot is held."""
        deadline = time.monotonic() + timeout
        while True:
            m = self.metrics()
            busy = {k: metric(m, k) for k in IDLE_ZERO if metric(m, k)}
            if not busy:
                return m
            if time.monotonic() > deadline:
                raise AssertionError(f"server not idle after {timeout}s: {busy}")
            time.sleep(0.05)


IDLE_ZERO = ("flashlane:num_requests_running", "flashlane:num_requests_waiting",
             "flashlane:cache_pages_used", "flashlane:state_slots_used")


def metric(scraped: dict[str, float], name: str, **labels) -> float:
    """Sum of the samples of ``name`` whose labels include ``labels``."""
    total, found = 0.0, False
    for key, value in scraped.items():
        base, _, rest = key.partition("{")
        if base != name:
            continue
        have = dict(re.findall(r'(\w+)="([^"]*)"', rest))
        if all(have.get(k) == str(v) for k, v in labels.items()):
            total += value
            found = True
    if not found:
        raise KeyError(f"metric {name}{labels or ''} not exported")
    return total
