"""AsyncEngine edges the server relies on: a request cancelled while its submission is queued
or running neither kills the stepping thread nor leaks (the client hung up at once)."""

from __future__ import annotations

import asyncio
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
        async def scenario():
            eng._call(time.sleep, 0.3)              # the stepping thread is busy
            task = asyncio.ensure_future(_consume(eng, "queued"))
            await asyncio.sleep(0.05)               # its add is waiting behind the sleep
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            await asyncio.sleep(0.5)
            return await eng.stats_snapshot()

        stats = asyncio.run(scenario())
        assert eng.alive, eng.error
        assert stats["running"] == stats["waiting"] == 0 and stats["pages_used"] == 0
        assert not eng.engine.requests
    finally:
        eng.shutdown()


def test_cancel_while_the_add_is_running_aborts_the_request():
    eng = _engine()
    real_add = eng.engine.add_request

    def slow_add(*args):
        time.sleep(0.3)
        return real_add(*args)

    eng.engine.add_request = slow_add
    try:
        async def scenario():
            task = asyncio.ensure_future(_consume(eng, "running"))
            await asyncio.sleep(0.1)                # the add has started on the engine thread
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

        asyncio.run(scenario())
        _wait_until(lambda: eng.engine.finish_reasons["abort"] == 1)  # the add completes, then the abort
        assert eng.alive
        assert not eng.engine.requests
        assert eng.engine.cache.usage()["pages_used"] == 0
    finally:
        eng.shutdown()


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")  # the thread dies on purpose
def test_shutdown_of_a_crashed_engine_returns_at_once():
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
    t = time.monotonic()
    eng.shutdown(timeout=10)
    assert time.monotonic() - t < 2
