"""Engine-process supervision (the process transport): a killed engine process is logged with its
cause and started again after a backoff, /health says "restarting" meanwhile, 503s carry
Retry-After and the client refuses with EngineDeadError; a profiling window open in the dead
process cannot be closed in the new one; once the restart limit is spent it stays dead and
/health says "error". The death-cause wording, the child's crash report and the restart policy
are checked directly."""

from __future__ import annotations

import asyncio
import json
import logging
import multiprocessing
import os
import signal
import threading
import time

import httpx
import pytest
from starlette.testclient import TestClient

from flashlane import SamplingParams
from flashlane.engine import core_process
from flashlane.engine.errors import EngineDeadError
from flashlane.engine.launch import engine_in_process, engine_in_thread
from flashlane.engine.messages import EngineDied, Ready
from flashlane.engine.process_exit import death_report, describe_exit
from flashlane.engine.restart_policy import RestartPolicy
from flashlane.server.app import create_app

from engine_models import preset
from server_harness import ENGINE_ARGS, LiveServer, metric

MODEL = "tiny-flash"
CORE_ARGS = {**ENGINE_ARGS, "num_threads": 1}
GREEDY = {"model": MODEL, "prompt": [5, 6, 7, 8, 9], "max_tokens": 8, "temperature": 0, "ignore_eos": True}


def _until(what: str, predicate, timeout: float = 300.0):
    """Poll ``predicate`` until it returns something truthy; fail naming ``what``."""
    deadline = time.monotonic() + timeout
    while not (value := predicate()):
        assert time.monotonic() < deadline, f"gave up waiting for {what}"
        time.sleep(0.05)
    return value


def _kill_with_two_requests_in_flight(srv) -> tuple[list[str], httpx.Response]:
    """SIGKILL the engine process while a non-streaming request and a stream run in it; the
    stream's data lines and the other request's response."""
    long = {**GREEDY, "max_tokens": 500}

    async def run():
        async with httpx.AsyncClient(base_url=srv.url, timeout=120) as ac:
            blocking = asyncio.create_task(ac.post("/v1/completions", json={**long, "prompt": "waits"}))
            async with ac.stream("POST", "/v1/completions", json={**long, "prompt": "streams", "stream": True}) as r:
                events = []
                async for line in r.aiter_lines():
                    if line.startswith("data: "):
                        events.append(line)
                        if len(events) == 1:
                            await asyncio.to_thread(_until, "both requests running",
                                                    lambda: srv.gauge("flashlane:num_requests_running") == 2)
                            os.kill(srv.engine.transport.pid, signal.SIGKILL)
            return events, await blocking

    return asyncio.run(run())


def _assert_unavailable(r: httpx.Response, retry_after: bool) -> None:
    assert r.status_code == 503, r.text
    assert r.json()["error"]["type"] == "server_error" and r.json()["error"]["code"] == "service_unavailable"
    if retry_after:
        assert int(r.headers["retry-after"]) >= 1
    else:
        assert "retry-after" not in r.headers


def test_a_killed_engine_process_is_restarted_then_given_up_on_past_the_limit(caplog, tmp_path, monkeypatch):
    caplog.set_level(logging.WARNING, logger="flashlane.engine")
    engine = engine_in_process(MODEL, max_restarts=1, restart_backoff=2.0, **CORE_ARGS)
    transport = engine.transport
    # the new process starts only once the "restarting" checks are done: a busy machine can
    # spend longer than the backoff on them, and then they would see the engine already back
    respawn_allowed, real_spawn = threading.Event(), transport._timed_spawn
    monkeypatch.setattr(transport, "_timed_spawn", lambda: (respawn_allowed.wait(300), real_spawn())[1])
    with LiveServer(None, MODEL, engine=engine) as srv, httpx.Client(base_url=srv.url, timeout=120) as c:
        first_pid = transport.pid
        asyncio.run(engine.start_profile())   # a window open in the engine process that will die
        before = c.post("/v1/completions", json=GREEDY)
        assert before.status_code == 200, before.text
        m = srv.metrics()
        assert metric(m, "flashlane:engine_state", state="running") == 1
        assert metric(m, "flashlane:engine_restarts_total") == 0

        # the death: both in-flight requests fail with 503, and a restart is on its way
        events, blocked = _kill_with_two_requests_in_flight(srv)
        assert events[-1] == "data: [DONE]"
        err = json.loads(events[-2][6:])["error"]
        assert err["code"] == "service_unavailable" and "killed by SIGKILL" in err["message"]
        _assert_unavailable(blocked, retry_after=True)
        health = c.get("/health")   # the backoff alone outlasts these checks
        assert health.status_code == 503 and health.json()["status"] == "restarting", health.text
        assert "killed by SIGKILL" in health.json()["error"] and int(health.headers["retry-after"]) >= 1
        _assert_unavailable(c.post("/v1/completions", json=GREEDY), retry_after=True)
        _assert_unavailable(c.get("/debug/steps"), retry_after=True)
        assert engine.state == "restarting" and not engine.alive and engine.retry_after >= 1
        with pytest.raises(EngineDeadError):   # the client itself refuses at once, it does not queue
            asyncio.run(_drain(engine.generate("meanwhile", GREEDY["prompt"], SamplingParams(max_tokens=2))))
        snap = asyncio.run(engine.stats_snapshot())
        assert snap["engine_state"] == "restarting" and snap["engine_restarts"] == 0
        m = srv.metrics()
        assert metric(m, "flashlane:engine_state", state="restarting") == 1
        assert metric(m, "flashlane:engine_state", state="running") == 0
        assert metric(m, "flashlane:num_requests_running") >= 0   # the last engine numbers stay

        # the new engine process serves the same greedy output; "restarting" until then
        respawn_allowed.set()
        seen = set()

        def serving_again() -> bool:
            r = c.get("/health")
            seen.add(r.json()["status"])
            return r.status_code == 200

        _until("/health 200 after the restart", serving_again)
        assert seen == {"restarting", "ok"}
        assert transport.pid != first_pid and transport.generation == 1 and engine.retry_after is None
        with pytest.raises(EngineDeadError, match="profiling window was open in died"):
            asyncio.run(engine.stop_profile(str(tmp_path)))
        after = c.post("/v1/completions", json=GREEDY)
        assert after.status_code == 200, after.text
        assert after.json()["choices"][0]["text"] == before.json()["choices"][0]["text"]
        m = srv.metrics()
        assert metric(m, "flashlane:engine_restarts_total") == 1
        assert metric(m, "flashlane:engine_state", state="running") == 1
        logged = caplog.text
        assert f"the engine process (pid {first_pid}) died: the engine process exited (killed by SIGKILL)" in logged
        assert "restarting the engine process in 2 s (restart 1 of at most 1" in logged
        assert "the engine process is serving again" in logged

        # a second death spends the limit of 1: it stays dead
        os.kill(transport.pid, signal.SIGKILL)
        _until("/health to report the second death", lambda: c.get("/health").status_code == 503)
        health = c.get("/health")
        assert health.json()["status"] == "error" and "killed by SIGKILL" in health.json()["error"]
        assert "retry-after" not in health.headers
        _assert_unavailable(c.post("/v1/completions", json=GREEDY), retry_after=False)
        _assert_unavailable(c.get("/debug/steps"), retry_after=False)
        m = srv.metrics()
        assert metric(m, "flashlane:engine_state", state="dead") == 1
        assert metric(m, "flashlane:engine_restarts_total") == 1
        assert metric(m, "flashlane:generation_tokens_total") > 0   # the last snapshot's numbers
        _until("the give-up to be logged", lambda: "not restarting the engine process" in caplog.text)
        profiling = TestClient(create_app(engine, MODEL, profile_dir=str(tmp_path)))   # no lifespan: same engine
        _assert_unavailable(profiling.post("/start_profile"), retry_after=False)
        assert engine.state == "dead" and transport.restarts == 1 and engine.retry_after is None
        assert asyncio.run(engine.stats_snapshot())["engine_restarts"] == 1


async def _drain(outs) -> None:
    async for _ in outs:
        pass


def _crashing_engine_class():
    class CrashingEngine:
        info, tokenizer = "info", None

        def __init__(self, model, **engine_args):
            pass

        def has_unfinished(self) -> bool:
            return True

        def step(self):
            raise RuntimeError("boom in a step")

        def close(self) -> None:
            pass

    return CrashingEngine


def test_a_crashed_step_reports_its_traceback_to_the_parent(monkeypatch):
    monkeypatch.setattr(core_process, "LLMEngine", _crashing_engine_class())
    parent, child = multiprocessing.Pipe()
    sigint = signal.getsignal(signal.SIGINT)
    try:
        with pytest.raises(RuntimeError, match="boom in a step"):   # the child's main function, run here
            core_process.run_engine_core(MODEL, {"num_threads": 1}, child)
    finally:
        signal.signal(signal.SIGINT, sigint)
    assert isinstance(parent.recv(), Ready)
    died = parent.recv()
    assert isinstance(died, EngineDied)
    message, tb = died.message, died.traceback
    assert message == "engine step failed: RuntimeError('boom in a step')"
    assert tb.startswith("Traceback (most recent call last):") and "in step" in tb
    assert tb.rstrip().endswith("RuntimeError: boom in a step")
    report = death_report(message, 1, tb)
    assert report.startswith("engine step failed: RuntimeError('boom in a step') (exit status 1)\nTraceback")


def test_death_causes_name_the_signal_or_the_exit_status():
    assert describe_exit(-signal.SIGKILL) == "killed by SIGKILL"
    assert describe_exit(-signal.SIGSEGV) == "killed by SIGSEGV"
    assert describe_exit(1) == "exit status 1"
    assert describe_exit(None) == "still running"
    reason = f"the engine process exited ({describe_exit(-9)})"
    assert death_report(reason, -9) == "the engine process exited (killed by SIGKILL)"   # said once


def test_restarts_back_off_exponentially_up_to_a_cap_and_stop_at_the_limit():
    policy = RestartPolicy(max_restarts=3, backoff_s=1.0, max_backoff_s=3.0, window_s=100.0)
    backoffs = []
    for now in (0.0, 10.0, 20.0):
        assert policy.may_restart(now)
        backoffs.append(policy.backoff(now))
        policy.record(now)
    assert backoffs == [1.0, 2.0, 3.0]
    assert not policy.may_restart(30.0)
    assert policy.may_restart(100.0) and policy.backoff(120.0) == 1.0   # older restarts are forgotten
    with pytest.raises(ValueError, match="--engine-restarts"):
        RestartPolicy(max_restarts=-1)
    with pytest.raises(ValueError, match="--engine-restart-backoff"):
        RestartPolicy(backoff_s=0)
    assert not RestartPolicy(max_restarts=0).may_restart(0.0)


def test_the_in_thread_engine_reports_running_then_dead():
    engine = engine_in_thread(preset(MODEL), **ENGINE_ARGS)
    with LiveServer(None, MODEL, engine=engine) as srv:
        assert engine.state == "running" and httpx.get(srv.url + "/health").json() == {"status": "ok"}
    assert engine.state == "dead"
