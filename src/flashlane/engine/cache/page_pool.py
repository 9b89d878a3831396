"""Pages with reference counts and a content registry (the pool tier of the prefix cache).

A page is private to one request until it is full; a full page may be *registered* under its
block key (``block_hash``), after which it is immutable and any request whose prefix has the
same key can reference it. When no request references a registered page it stays cached in an
LRU list and is only reused when the free list is empty: the cache uses only what is free.
Page 0 is the null page and is never handed out.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Callable


class PagePool:
    def __init__(self, capacity: int, on_evict: Callable[[bytes, int], bool] | None = None,
                 on_forget: Callable[[bytes], None] | None = None):
        if capacity < 0:
            raise ValueError(f"pages capacity must be >= 0, got {capacity}")
        self.capacity = capacity
        self._free = list(range(capacity, 0, -1))      # pop() yields 1, 2, ... first
        self._ref: dict[int, int] = {}
        self.key_of: dict[int, bytes] = {}
        self.page_of: dict[bytes, int] = {}
        self._parent: dict[bytes, bytes | None] = {}
        self._children: dict[bytes, set[bytes]] = {}
        self._lru: OrderedDict[int, None] = OrderedDict()   # cached pages nobody references
        # called with (key, page) before an evicted page is reused; True = a lower tier kept it
        self.on_evict = on_evict
        # called with each key that leaves the registry (its checkpoint must go with it)
        self.on_forget = on_forget
        self.num_evicted = 0

    # ---- counts ------------------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        """Pages a request can get now: truly free plus cached-but-unreferenced."""
        return len(self._free) + len(self._lru)

    @property
    def num_used(self) -> int:
        """Pages referenced by at least one request."""
        return len(self._ref)

    @property
    def num_cached(self) -> int:
        """Registered pages no request references (reusable, reclaimable)."""
        return len(self._lru)

    def is_evictable(self, page: int) -> bool:
        return page in self._lru

    # ---- allocation ----------------------------------------------------------------------------
    def allocate(self, n: int) -> list[int]:
        if n > self.num_free:
            raise MemoryError(f"pages: asked for {n}, {self.num_free} free")
        out = []
        for _ in range(n):
            page = self._free.pop() if self._free else self._evict_oldest()
            self._ref[page] = 1
            out.append(page)
        return out

    def acquire(self, pages: list[int]) -> None:
        """Reference registered pages (a prefix hit)."""
        for p in pages:
            if p in self._lru:
                del self._lru[p]
                self._ref[p] = 1
            elif p in self._ref:
                self._ref[p] += 1
            else:
                raise ValueError(f"pages: page {p} is neither cached nor in use")

    def release(self, pages: list[int]) -> None:
        """Drop one reference from each page; the last one frees it or leaves it cached. Deeper
        pages of a sequence enter the LRU list first, so they are evicted before their prefix."""
        for p in reversed(pages):
            n = self._ref.get(p)
            if n is None:
                raise ValueError(f"pages: page {p} is not allocated")
            if n > 1:
                self._ref[p] = n - 1
                continue
            del self._ref[p]
            if p in self.key_of:
                self._lru[p] = None
            else:
                self._free.append(p)

    # ---- registry ------------------------------------------------------------------------------
    def register(self, page: int, key: bytes, parent: bytes | None) -> bool:
        """Make a full page findable under ``key``; False when another page already holds it."""
        if key in self.page_of or page in self.key_of:
            return False
        self.page_of[key] = page
        self.key_of[page] = key
        self._parent[key] = parent
        if parent is not None:
            self._children.setdefault(parent, set()).add(key)
        return True

    def lookup(self, keys: list[bytes]) -> list[int]:
        """Pages of the longest run of ``keys`` from the start that are registered here."""
        out = []
        for k in keys:
            p = self.page_of.get(k)
            if p is None:
                break
            out.append(p)
        return out

    def _evict_oldest(self) -> int:
        page, _ = self._lru.popitem(last=False)
        key = self.key_of[page]
        kept = bool(self.on_evict and self.on_evict(key, page))
        if not kept:
            # nothing below holds this prefix any more: pages after it can never be hit again
            self._drop_descendants(key)
        self._unregister(key)
        self.num_evicted += 1
        return page

    def _unregister(self, key: bytes) -> None:
        if self.on_forget:
            self.on_forget(key)
        page = self.page_of.pop(key)
        del self.key_of[page]
        parent = self._parent.pop(key, None)
        if parent is not None and parent in self._children:
            self._children[parent].discard(key)
        self._children.pop(key, None)

    def _drop_descendants(self, key: bytes) -> None:
        stack = list(self._children.get(key, ()))
        while stack:
            k = stack.pop()
            stack.extend(self._children.get(k, ()))
            page = self.page_of.get(k)
            if page is None:
                continue
            self._unregister(k)
            if page in self._lru:
                del self._lru[page]
                self._free.append(page)
