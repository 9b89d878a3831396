"""State checkpoints of the prefix cache: a budgeted pool of state rows keyed by block key.

A checkpoint under key ``h_i`` is a bit-exact copy of a sequence's per-sequence state (KDA
recurrent + conv, indexer tail) right after it computed page ``i`` — the state a hybrid hit of
that prefix must start from. Checkpoints are copied in and out at once (a hit restores it into
the request's own slot), so none is ever referenced by a running request: plain LRU suffices.
Rows live after the sequence slots in the slot pools (see ``snapshots.py``).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Callable

from .snapshots import StateSnapshots


class CheckpointPool:
    def __init__(self, snapshots: StateSnapshots, first_row: int, capacity: int,
                 on_evict: Callable[[bytes, int], None] | None = None):
        self.snapshots = snapshots
        self.capacity = capacity
        self._free = list(range(first_row + capacity - 1, first_row - 1, -1))
        self._row_of: OrderedDict[bytes, int] = OrderedDict()    # LRU order, oldest first
        self.on_evict = on_evict      # (key, row) before an evicted row is reused
        self.num_saved = 0
        self.num_evicted = 0

    @property
    def num_used(self) -> int:
        return len(self._row_of)

    def __contains__(self, key: bytes) -> bool:
        return key in self._row_of

    def items(self) -> list[tuple[bytes, int]]:
        return list(self._row_of.items())

    def save(self, key: bytes, slot: int) -> bool:
        """Checkpoint the state in ``slot`` under ``key`` (a no-op when it is already stored)."""
        if self.capacity == 0:
            return False
        if key in self._row_of:
            self._row_of.move_to_end(key)
            return True
        row = self._take_row()
        self.snapshots.copy(slot, row)
        self._row_of[key] = row
        self.num_saved += 1
        return True

    def store(self, key: bytes, data: dict) -> bool:
        """Put an exported checkpoint (from a lower tier) back into the pool."""
        if self.capacity == 0:
            return False
        if key not in self._row_of:
            row = self._take_row()
            self.snapshots.load(data, row)
            self._row_of[key] = row
        return True

    def restore(self, key: bytes, slot: int) -> None:
        row = self._row_of[key]
        self._row_of.move_to_end(key)
        self.snapshots.copy(row, slot)

    def drop(self, key: bytes) -> None:
        row = self._row_of.pop(key, None)
        if row is not None:
            self.snapshots.clear(row)
            self._free.append(row)

    def _take_row(self) -> int:
        if self._free:
            return self._free.pop()
        key, row = self._row_of.popitem(last=False)
        if self.on_evict:
            self.on_evict(key, row)
        self.num_evicted += 1
        return row
