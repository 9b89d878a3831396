"""Free-list allocator for per-sequence state slots. Id 0 is the null entry."""

from __future__ import annotations


class FreeList:
    """Hands out ids 1..capacity; 0 is reserved as the null/padding target."""

    def __init__(self, capacity: int, name: str):
        if capacity < 0:
            raise ValueError(f"{name} capacity must be >= 0, got {capacity}")
        self.name = name
        self.capacity = capacity
        self._free = list(range(capacity, 0, -1))  # pop() yields 1, 2, ... first
        self._used: set[int] = set()

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return len(self._used)

    def allocate(self, n: int = 1) -> list[int]:
        if n > len(self._free):
            raise MemoryError(f"{self.name}: asked for {n}, {len(self._free)} free")
        ids = [self._free.pop() for _ in range(n)]
        self._used.update(ids)
        return ids

    def free(self, ids: list[int]) -> None:
        for i in ids:
            if i not in self._used:
                raise ValueError(f"{self.name}: id {i} is not allocated")
            self._used.remove(i)
            self._free.append(i)
