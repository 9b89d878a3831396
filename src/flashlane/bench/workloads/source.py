"""A workload = an indexable, seeded source of traces (session trees)."""

from __future__ import annotations

import hashlib
import json
import random
from dataclasses import dataclass, field
from typing import Callable

from .model import Trace


@dataclass
class WorkloadSource:
    name: str  # "agentic", "multiturn", "fixed"
    spec: dict  # everything that defines the workload (goes to the manifest)
    make: Callable[[int], Trace]  # session index -> trace
    default_endpoint: str = "chat"
    _cache: dict = field(default_factory=dict, repr=False)

    def trace(self, idx: int) -> Trace:
        t = self._cache.get(idx)
        if t is None:
            t = self.make(idx)
            if len(self._cache) < 10000:
                self._cache[idx] = t
        return t

    @property
    def content_hash(self) -> str:
        return hashlib.sha256(json.dumps(self.spec, sort_keys=True, default=str).encode()).hexdigest()[:16]


def cycling_draw(traces: list[Trace], seed: int) -> Callable[[int], Trace]:
    """Session index -> trace: seeded shuffles of the list, one after another (timing-independent)."""
    n = len(traces)

    def make(idx: int) -> Trace:
        epoch, pos = divmod(idx, n)
        order = list(range(n))
        random.Random(f"{seed}:{epoch}").shuffle(order)
        return traces[order[pos]]

    return make
