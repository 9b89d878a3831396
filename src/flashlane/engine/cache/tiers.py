"""Lower tiers of the prefix cache: host memory, then files on disk (``disk_tier``).

Pages and checkpoints evicted from the pool are exported (CPU tensors per pool) into the host
tier, an LRU store with its own byte budget; what the host tier evicts goes to the disk tier.
Disk reads run on a loader thread (``disk_loader``) into a request's staging area, so a request
waiting for disk does not hold up anyone's step. A load still in flight after
``load_timeout_s`` is given up: the key is forgotten (the request recomputes that part) and a
loader stuck in a read is replaced by a fresh one. The disk tier is best effort: whatever it
does, serving goes on from the pool and the host tier.
On a GPU the host tier would be pinned memory; on CPU both tiers are RAM/disk sized separately.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass

import torch

from .disk_loader import DiskLoader
from .disk_tier import DiskTier, Key, TierState
from .rate_limited_log import RateLimitedLog

log = logging.getLogger("flashlane.cache")

__all__ = ["CacheTiers", "DiskTier", "HostTier", "Key", "TierState"]


def _nbytes(data: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in data.values())


class HostTier:
    def __init__(self, capacity: int):
        self.capacity = capacity
        self.used = 0
        self._items: OrderedDict[Key, dict] = OrderedDict()

    def __contains__(self, key: Key) -> bool:
        return key in self._items

    def get(self, key: Key) -> dict:
        self._items.move_to_end(key)
        return self._items[key]

    def put(self, key: Key, data: dict) -> list[tuple[Key, dict]]:
        """Store ``data``; returns what had to leave to make room (oldest first)."""
        size = _nbytes(data)
        if size > self.capacity:
            return [(key, data)]
        if key in self._items:
            self._items.move_to_end(key)
            return []
        out = []
        while self.used + size > self.capacity:
            k, d = self._items.popitem(last=False)
            self.used -= _nbytes(d)
            out.append((k, d))
        self._items[key] = data
        self.used += size
        return out


@dataclass(eq=False)
class _Load:
    key: Key
    staged: dict
    since: float              # submitted, then reset when the loader starts it
    started: bool = False


class CacheTiers:
    def __init__(self, host_bytes: int, disk_dir: str | None, disk_bytes: int | None, namespace: str,
                 load_timeout_s: float = 5.0):
        self.host = HostTier(int(host_bytes)) if host_bytes else None
        self.disk = DiskTier(disk_dir, namespace, disk_bytes) if disk_dir else None
        self.load_timeout_s = load_timeout_s
        self._counts: dict[str, int] = {k: 0 for k in (
            "host_page_writes", "host_checkpoint_writes", "host_evictions", "disk_page_writes",
            "disk_checkpoint_writes", "disk_evictions", "disk_reads", "disk_load_timeouts",
            "disk_writeback_skipped")}
        self._lock = threading.Lock()
        self._loader: DiskLoader | None = None
        self._in_flight: dict[Key, _Load] = {}
        self._log = RateLimitedLog(log)

    @property
    def counters(self) -> dict[str, int]:
        """Tier counters, the disk tier's faults included (``disk_errors_<op>``, ``disk_rejected``...)."""
        return {**self._counts, **(self.disk.counters if self.disk is not None else {})}

    def count(self, name: str, n: int = 1) -> None:
        with self._lock:
            self._counts[name] += n

    def tier_of(self, kind: str, key: bytes) -> str | None:
        k = (kind, key)
        if self.host is not None and k in self.host:
            return "host"
        if self.disk is not None and k in self.disk:
            return "disk"
        return None

    def get(self, kind: str, key: bytes) -> dict:
        """An entry of the host tier (disk entries come through ``prefetch``)."""
        return self.host.get((kind, key))

    # ---- writing ---------------------------------------------------------------------------------
    def put(self, kind: str, key: bytes, data: dict) -> bool:
        """Keep an entry evicted from the pool; False when no tier has room for it."""
        k = (kind, key)
        if self.host is None:
            return self._to_disk(k, data)
        spilled = self.host.put(k, data)
        self.count(f"host_{kind}_writes")
        kept = True
        for sk, sd in spilled:
            self.count("host_evictions")
            stored = self._to_disk(sk, sd)
            if sk == k:
                kept = stored
        return kept

    @property
    def disk_writable(self) -> bool:
        return self.disk is not None and self.disk.state == TierState.READ_WRITE

    def persist(self, kind: str, key: bytes, data: dict) -> bool:
        """Write an entry straight to disk (write-back at shutdown)."""
        return self._to_disk((kind, key), data)

    def _to_disk(self, key: Key, data: dict) -> bool:
        if self.disk is None:
            return False
        try:
            stored, evicted = self.disk.put(key, data)
        except Exception as e:      # DiskTier handles OSError; nothing else may reach the engine either
            self._log.warning(f"write {type(e).__name__}", f"prefix cache disk tier: write failed ({e!r}); skipped")
            return False
        self.count(f"disk_{key[0]}_writes", int(stored))
        self.count("disk_evictions", evicted)
        return stored

    # ---- loading ---------------------------------------------------------------------------------
    def prefetch(self, keys: list[Key], staged: dict) -> None:
        """Read disk entries into ``staged`` on the loader thread (unreadable ones are dropped)."""
        if self.disk is None:
            return
        now = time.monotonic()
        with self._lock:
            todo = [_Load(k, staged, now) for k in keys if k not in self._in_flight and k in self.disk]
            for load in todo:
                self._in_flight[load.key] = load
        if not todo:
            return
        if self._loader is None:
            self._loader = DiskLoader(self._load)
        for load in todo:
            self._loader.submit(load)

    def expire_loads(self) -> None:
        """Give up loads in flight past the deadline: their keys are forgotten, so the next lookup
        stops at them and the request recomputes that part. A loader stuck in a read is replaced
        first (the loads queued behind it move to the fresh one and restart their clock); a load
        still queued is given up only when it waited the deadline since the loader took its
        current job."""
        if not self._in_flight:
            return
        now, deadline = time.monotonic(), self.load_timeout_s
        if self._loader is not None and self._loader.stuck(deadline, now):
            self._loader = self._loader.replace()
            with self._lock:
                for load in self._in_flight.values():
                    if not load.started:
                        load.since = now
        # a queued load waits for the job in hand: its clock runs from when that job started at the
        # earliest, so loads queued behind a read that turns out stuck are not given up before it
        busy_since = self._loader.busy_since if self._loader is not None else None
        with self._lock:
            expired = [load for load in self._in_flight.values()
                       if now - (load.since if load.started or busy_since is None else max(load.since, busy_since))
                       > deadline]
            for load in expired:
                del self._in_flight[load.key]
                self._counts["disk_load_timeouts"] += 1
        for load in expired:
            self.disk.forget(load.key)
            self._log.warning("load timeout", f"prefix cache disk tier: loading {self.disk.path(load.key).name} "
                                              f"took over {deadline:g}s (disk_load_timeout_s); given up, recomputed")

    def _load(self, load: _Load) -> None:
        with self._lock:
            if self._in_flight.get(load.key) is not load:       # given up before it started
                return
            load.since, load.started = time.monotonic(), True
        try:
            data = self.disk.read(load.key)
        except Exception as e:      # DiskTier handles OSError; a miss whatever else goes wrong
            self._log.warning(f"read {type(e).__name__}", f"prefix cache disk tier: read failed ({e!r}); skipped")
            self.disk.forget(load.key)
            data = None
        with self._lock:
            if self._in_flight.get(load.key) is not load:       # given up while reading
                return
            del self._in_flight[load.key]
            if data is not None:
                load.staged[load.key] = data
                self._counts["disk_reads"] += 1

    # ---- reporting and shutdown ------------------------------------------------------------------
    def usage(self) -> dict[str, int]:
        out = {}
        if self.host is not None:
            out.update(host_cache_bytes_used=self.host.used, host_cache_bytes_total=self.host.capacity)
        if self.disk is not None:
            out.update(disk_cache_bytes_used=self.disk.used, disk_cache_bytes_total=self.disk.capacity or 0,
                       disk_cache_state=int(self.disk.state))
        return out

    def close(self, timeout_s: float = 2.0) -> None:
        """Stop the loader; one stuck in a read is abandoned (a daemon thread) after ``timeout_s``."""
        loader, self._loader = self._loader, None
        if loader is not None and not loader.stop(timeout_s):
            log.warning("prefix cache disk loader still busy %gs after shutdown began; abandoned", timeout_s)
