"""An asyncio event loop that runs in virtual time.

The loop's clock starts at 0 and only moves when every task is waiting: then it jumps straight to
the next timer instead of sleeping until it is due. Code that waits with ``asyncio.sleep`` /
``wait_for`` and reads ``loop.time()`` (or the bench clock, which ``run_virtual`` points at the
loop) runs unchanged, as fast as the CPU allows, and sees exactly the durations it scheduled. There
is no real I/O in a simulation (its HTTP is an in-memory transport), so the loop never polls a
socket; a task that waits for something nothing will ever deliver is a stall, and is raised as one.
"""

from __future__ import annotations

import asyncio
import selectors
from collections.abc import Coroutine
from typing import Any, TypeVar

from ..bench.clock import use_clock

T = TypeVar("T")


class SimulationStalled(RuntimeError):
    """Every task waits, and no timer is due: nothing can ever happen again."""


class _VirtualSelector(selectors.BaseSelector):
    """Keeps the registrations the loop makes (its self-pipe) and never waits: ``select(timeout)``
    advances the virtual clock by ``timeout``."""

    def __init__(self) -> None:
        self._keys: dict[Any, selectors.SelectorKey] = {}
        self.now = 0.0

    def register(self, fileobj, events, data=None):
        key = selectors.SelectorKey(fileobj, self._fd(fileobj), events, data)
        self._keys[fileobj] = key
        return key

    def unregister(self, fileobj):
        return self._keys.pop(fileobj)

    def modify(self, fileobj, events, data=None):
        self._keys.pop(fileobj, None)
        return self.register(fileobj, events, data)

    def select(self, timeout=None):
        if timeout is None:
            raise SimulationStalled("every task of the simulation is waiting and no timer is due")
        if timeout > 0:
            self.now += timeout
        return []

    def get_map(self):
        return self._keys

    def close(self) -> None:
        self._keys.clear()

    @staticmethod
    def _fd(fileobj) -> int:
        return fileobj if isinstance(fileobj, int) else fileobj.fileno()


class VirtualTimeLoop(asyncio.SelectorEventLoop):
    def __init__(self, start: float = 0.0) -> None:
        self._virtual = _VirtualSelector()
        self._virtual.now = start
        super().__init__(selector=self._virtual)

    def time(self) -> float:
        return self._virtual.now


def run_virtual(coro: Coroutine[Any, Any, T], start: float = 0.0) -> T:
    """Run ``coro`` to completion on a fresh virtual-time loop whose clock starts at ``start``
    (a simulation that goes on where an earlier run ended), with the bench clock reading it."""
    loop = VirtualTimeLoop(start)
    try:
        asyncio.set_event_loop(loop)
        with use_clock(loop.time):
            return loop.run_until_complete(coro)
    finally:
        try:
            loop.run_until_complete(loop.shutdown_asyncgens())
        finally:
            asyncio.set_event_loop(None)
            loop.close()
