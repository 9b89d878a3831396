"""AsyncEngine edges the server relies on: a request cancelled while its submission is queued
or running neither kills the stepping thread nor leaks (the client hung up at once)."""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
import time

import pytest

from flashlane import SamplingParams
from flashlane.engine.async_engine import AsyncEngine

from engine_models import tiny_llama

PARAMS = SamplingParams(max_tokens=50, temperature=0, ignore_eos=True)


def _engine() -> AsyncEngine:
    eng = AsyncEngine(tiny_llama(), dtype="float32", cache_memory=8 << 20)
    eng.start()
    return eng


async def _consume(eng, rid):
    async for _ in eng.generate(rid, [65, 66, 67], PARAMS):
        pass


def _wait_until(cond, timeout=10.0):
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline
        time.sleep(0.01)


def test_cancel_while_the_add_is_queued_keeps_the_engine_alive():
    eng = _engine()
    try:
        gate = threading.Event()

        async def scenario():
            eng._call(gate.wait, 30)                # the stepping thread is busy until the gate opens
            task = asyncio.ensure_future(_consume(eng, "queued"))
            await asyncio.sleep(0.05)               # the task has run: its add waits behind the gate
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            gate.set()
            # commands run in order: the snapshot is taken after the add was skipped and the abort ran
            return await eng.stats_snapshot(timeout=30)

        stats = asyncio.run(scenario())
        assert eng.alive, eng.error
        assert stats["running"] == stats["waiting"] == 0 and stats["pages_used"] == 0
        assert not eng.engine.requests
    finally:
        eng.shutdown()


def test_cancel_while_the_add_is_running_aborts_the_request():
    eng = _engine()
    real_add = eng.engine.add_request
    started, release = threading.Event(), threading.Event()

    def slow_add(*args):
        started.set()
        release.wait(30)
        return real_add(*args)

    eng.engine.add_request = slow_add
    try:
        async def scenario():
            task = asyncio.ensure_future(_consume(eng, "running"))
            for _ in range(3000):                   # wait (<= 30 s) until the add runs on the engine thread
                if started.is_set():
                    break
                await asyncio.sleep(0.01)
            assert started.is_set()
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            release.set()

        asyncio.run(scenario())
        _wait_until(lambda: eng.engine.finish_reasons["abort"] == 1, timeout=30)  # the add completes, then the abort
        assert eng.alive
        assert not eng.engine.requests
        assert eng.engine.cache.usage()["pages_used"] == 0
    finally:
        eng.shutdown()


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")  # the thread dies on purpose
def test_shutdown_of_a_crashed_engine_returns_at_once(monkeypatch):
    eng = _engine()
    eng.engine.step = lambda: (_ for _ in ()).throw(RuntimeError("boom"))

    async def scenario():
        try:
            await _consume(eng, "doomed")
        except Exception as exc:
            return exc

    err = asyncio.run(scenario())
    assert "boom" in str(err)
    assert not eng.alive
    # a crashed thread never answers the abort: shutdown must not wait for it (counted, not timed)
    waits = []
    real_wait = concurrent.futures.wait
    monkeypatch.setattr(concurrent.futures, "wait", lambda *a, **k: waits.append(1) or real_wait(*a, **k))
    eng.shutdown(timeout=30)
    assert waits == []
    assert not eng.alive
