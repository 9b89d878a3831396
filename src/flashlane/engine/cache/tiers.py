"""Lower tiers of the prefix cache: host memory, then files on disk.

Pages and checkpoints evicted from the pool are exported (CPU tensors per pool) into the host
tier, an LRU store with its own byte budget; what the host tier evicts goes to the disk tier,
one file per entry under ``<dir>/<namespace>/``, where the namespace is the root block key (a
fingerprint of the weights and the cache layout), so a server restarted on the same directory
with the same model hits what the old one stored and any other model never sees it. A file is
``blake2b digest || safetensors payload``; a digest mismatch or a payload that does not decode
is counted, deleted and treated as a miss, never served. Disk reads run on a loader thread into
a request's staging area, so a request waiting for disk does not hold up anyone's step.
On a GPU the host tier would be pinned memory; on CPU both tiers are RAM/disk sized separately.
"""

from __future__ import annotations

import hashlib
import os
import threading
from collections import Counter, OrderedDict
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

_DIGEST = 16
Key = tuple[str, bytes]       # (kind, block key): kind is "page" or "checkpoint"


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


class DiskTier:
    def __init__(self, root: str | os.PathLike, namespace: str, capacity: int | None):
        self.dir = Path(root) / namespace
        self.dir.mkdir(parents=True, exist_ok=True)
        probe = self.dir / ".write-test"
        probe.write_bytes(b"ok")
        probe.unlink()
        self.capacity = capacity
        self._lock = threading.Lock()
        self._index: OrderedDict[Key, int] = OrderedDict()       # key -> file bytes, oldest first
        found = []
        for f in self.dir.glob("*.st"):
            key = self._key_of(f.name)
            if key is not None:
                st = f.stat()
                found.append((st.st_mtime, key, st.st_size))
        for _, key, size in sorted(found):
            self._index[key] = size
        self.used = sum(self._index.values())

    @staticmethod
    def _key_of(name: str) -> Key | None:
        kind, _, rest = name[:-3].partition("-")
        try:
            return (kind, bytes.fromhex(rest)) if kind in ("page", "checkpoint") else None
        except ValueError:
            return None

    def path(self, key: Key) -> Path:
        return self.dir / f"{key[0]}-{key[1].hex()}.st"

    def __contains__(self, key: Key) -> bool:
        return key in self._index

    def put(self, key: Key, data: dict) -> tuple[bool, int]:
        """Write an entry; returns (stored, number of files evicted for room)."""
        payload = st_save({k: v.contiguous() for k, v in data.items()})
        blob = hashlib.blake2b(payload, digest_size=_DIGEST).digest() + payload
        if self.capacity is not None and len(blob) > self.capacity:
            return False, 0
        evicted = 0
        with self._lock:
            if key in self._index:
                return True, 0
            while self.capacity is not None and self.used + len(blob) > self.capacity and self._index:
                old, size = self._index.popitem(last=False)
                self.used -= size
                self.path(old).unlink(missing_ok=True)
                evicted += 1
        tmp = self.path(key).with_suffix(".tmp")
        tmp.write_bytes(blob)
        os.replace(tmp, self.path(key))
        with self._lock:
            self._index[key] = len(blob)
            self.used += len(blob)
        return True, evicted

    def read(self, key: Key) -> dict | None:
        """The entry, or None when it is missing, truncated or corrupt (the file is then removed)."""
        try:
            blob = self.path(key).read_bytes()
            digest, payload = blob[:_DIGEST], blob[_DIGEST:]
            if len(blob) <= _DIGEST or hashlib.blake2b(payload, digest_size=_DIGEST).digest() != digest:
                raise ValueError("checksum mismatch")
            return st_load(payload)
        except Exception:
            self.discard(key)
            return None

    def discard(self, key: Key) -> None:
        with self._lock:
            size = self._index.pop(key, None)
            if size is not None:
                self.used -= size
        self.path(key).unlink(missing_ok=True)


class CacheTiers:
    def __init__(self, host_bytes: int, disk_dir: str | None, disk_bytes: int | None, namespace: str):
        self.host = HostTier(int(host_bytes)) if host_bytes else None
        self.disk = DiskTier(disk_dir, namespace, disk_bytes) if disk_dir else None
        self.counters: Counter = Counter({k: 0 for k in (
            "host_page_writes", "host_checkpoint_writes", "host_evictions", "disk_page_writes",
            "disk_checkpoint_writes", "disk_evictions", "disk_reads", "disk_corrupt")})
        self._loader: ThreadPoolExecutor | None = None
        self._in_flight: set[Key] = set()

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

    def put(self, kind: str, key: bytes, data: dict) -> bool:
        """Keep an entry evicted from the pool; False when no tier has room for it."""
        k = (kind, key)
        if self.host is None:
            return self._to_disk(k, data)
        spilled = self.host.put(k, data)
        self.counters[f"host_{kind}_writes"] += 1
        kept = True
        for sk, sd in spilled:
            self.counters["host_evictions"] += 1
            stored = self._to_disk(sk, sd)
            if sk == k:
                kept = stored
        return kept

    def persist(self, kind: str, key: bytes, data: dict) -> bool:
        """Write an entry straight to disk (write-back at shutdown)."""
        return self._to_disk((kind, key), data)

    def _to_disk(self, key: Key, data: dict) -> bool:
        if self.disk is None:
            return False
        stored, evicted = self.disk.put(key, data)
        self.counters[f"disk_{key[0]}_writes"] += int(stored)
        self.counters["disk_evictions"] += evicted
        return stored

    def prefetch(self, keys: list[Key], staged: dict) -> None:
        """Read disk entries into ``staged`` on the loader thread (corrupt ones are dropped)."""
        todo = [k for k in keys if k not in self._in_flight]
        if not todo:
            return
        self._in_flight.update(todo)
        if self._loader is None:
            self._loader = ThreadPoolExecutor(max_workers=1, thread_name_prefix="flashlane-cache-load")
        self._loader.submit(self._load, todo, staged)

    def _load(self, keys: list[Key], staged: dict) -> None:
        for k in keys:
            data = self.disk.read(k)
            if data is None:
                self.counters["disk_corrupt"] += 1
            else:
                staged[k] = data
                self.counters["disk_reads"] += 1
            self._in_flight.discard(k)

    def usage(self) -> dict[str, int]:
        out = {}
        if self.host is not None:
            out.update(host_cache_bytes_used=self.host.used, host_cache_bytes_total=self.host.capacity)
        if self.disk is not None:
            out.update(disk_cache_bytes_used=self.disk.used, disk_cache_bytes_total=self.disk.capacity or 0)
        return out

    def close(self) -> None:
        if self._loader is not None:
            self._loader.shutdown(wait=True)
            self._loader = None
