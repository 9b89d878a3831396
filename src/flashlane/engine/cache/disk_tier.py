"""The disk tier of the prefix cache: one file per entry under ``<dir>/<namespace>/``, where the
namespace is the root block key (a fingerprint of the weights and the cache layout), so a server
restarted on the same directory with the same model hits what the old one stored and any other
model never sees it. A file is ``blake2b digest || safetensors payload``; a digest mismatch or a
payload that does not decode is counted (``disk_corrupt``), deleted and treated as a miss.

Best effort by construction: every file operation catches OSError, skips the entry (a miss, or
not stored), counts it by operation (``disk_errors_read/write/remove/list``) and logs once per
cause. Only regular files are read: lstat (no symlinks), open with O_NOFOLLOW|O_NONBLOCK and
fstat the descriptor, so a FIFO, device or directory at an entry's name is rejected
(``disk_rejected``), never waited on. Repeated write failures that mean the disk takes no more
(full, quota, read-only, I/O error, permission) make the tier read-only; repeated read I/O errors,
or the directory vanishing, turn it off. Serving goes on from the pool and host tier regardless.
"""

from __future__ import annotations

import errno
import hashlib
import logging
import os
import stat
import threading
from collections import Counter, OrderedDict
from enum import IntEnum
from pathlib import Path

import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from .rate_limited_log import RateLimitedLog

log = logging.getLogger("flashlane.cache")

DIGEST = 16
Key = tuple[str, bytes]       # (kind, block key): kind is "page" or "checkpoint"
FAILURES_TO_DEGRADE = 3       # consecutive storage failures before the tier stops writing / reading
_STORAGE_ERRNOS = {getattr(errno, n) for n in ("ENOSPC", "EDQUOT", "EROFS", "EIO", "EACCES", "EPERM")
                   if hasattr(errno, n)}
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_READ_FLAGS = os.O_RDONLY | os.O_NONBLOCK | _NOFOLLOW
# O_NONBLOCK: opening a FIFO for writing with no reader fails (ENXIO) instead of waiting for one
_WRITE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NONBLOCK | _NOFOLLOW


class TierState(IntEnum):
    OFF = 0
    READ_ONLY = 1
    READ_WRITE = 2


def _errno_name(err: OSError) -> str:
    return errno.errorcode.get(err.errno, str(err.errno)) if err.errno is not None else "unknown"


class DiskTier:
    def __init__(self, root: str | os.PathLike, namespace: str, capacity: int | None):
        self.dir = Path(root) / namespace
        # at start-up an unusable directory is a configuration error: raised (the engine says which flag)
        self.dir.mkdir(parents=True, exist_ok=True)
        probe = self.dir / ".write-test"
        probe.write_bytes(b"ok")
        probe.unlink()
        self.capacity = capacity
        self.state = TierState.READ_WRITE
        self.counters: Counter = Counter({k: 0 for k in (
            "disk_corrupt", "disk_rejected", "disk_errors_read", "disk_errors_write", "disk_errors_remove",
            "disk_errors_list")})
        self._lock = threading.RLock()
        self._log = RateLimitedLog(log)
        self._write_failures = 0      # consecutive storage-class write failures
        self._read_failures = 0       # consecutive read I/O errors
        self._blocked: set[Key] = set()    # names held by something we cannot remove (a directory)
        self._index: OrderedDict[Key, int] = OrderedDict()       # key -> file bytes, oldest first
        self.used = 0
        self._scan()

    @staticmethod
    def _key_of(name: str) -> Key | None:
        if not name.endswith(".st"):
            return None
        kind, _, rest = name[:-3].partition("-")
        try:
            return (kind, bytes.fromhex(rest)) if kind in ("page", "checkpoint") else None
        except ValueError:
            return None

    def _scan(self) -> None:
        """Index the regular entry files already there, oldest first."""
        found = []
        try:
            with os.scandir(self.dir) as entries:
                for entry in entries:
                    key = self._key_of(entry.name)
                    if key is None:
                        continue
                    try:
                        st = os.lstat(entry.path)
                    except OSError as e:
                        self._error("list", e, entry.name)
                        continue
                    if stat.S_ISREG(st.st_mode):
                        found.append((st.st_mtime, key, st.st_size))
                    else:
                        self._reject(key, "is not a regular file")
        except OSError as e:
            self._error("list", e, str(self.dir))
        for _, key, size in sorted(found):
            self._index[key] = size
        self.used = sum(self._index.values())

    def path(self, key: Key) -> Path:
        return self.dir / f"{key[0]}-{key[1].hex()}.st"

    def __contains__(self, key: Key) -> bool:
        return key in self._index

    # ---- writing ---------------------------------------------------------------------------------
    def put(self, key: Key, data: dict[str, torch.Tensor]) -> tuple[bool, int]:
        """Write an entry; returns (stored, number of files evicted for room). Never raises for
        the disk's sake: a failed write is counted and the entry is simply not stored."""
        if self.state != TierState.READ_WRITE or key in self._blocked:
            return False, 0
        payload = st_save({k: v.contiguous() for k, v in data.items()})
        blob = hashlib.blake2b(payload, digest_size=DIGEST).digest() + payload
        if self.capacity is not None and len(blob) > self.capacity:
            return False, 0
        evicted = []
        with self._lock:
            if key in self._index:
                return True, 0
            while self.capacity is not None and self.used + len(blob) > self.capacity and self._index:
                old, size = self._index.popitem(last=False)
                self.used -= size
                evicted.append(old)
        for old in evicted:
            self._remove(self.path(old))
        if not self._write(key, blob):
            return False, len(evicted)
        with self._lock:
            if self.state != TierState.OFF and key not in self._index:
                self._index[key] = len(blob)
                self.used += len(blob)
        return True, len(evicted)

    def _write(self, key: Key, blob: bytes) -> bool:
        path = self.path(key)
        tmp = path.with_suffix(".tmp")
        try:
            fd = os.open(tmp, _WRITE_FLAGS, 0o644)
            try:
                if not stat.S_ISREG(os.fstat(fd).st_mode):
                    raise OSError(errno.EINVAL, "not a regular file", str(tmp))
                view = memoryview(blob)
                while view:
                    view = view[os.write(fd, view):]
            finally:
                os.close(fd)
            os.replace(tmp, path)
        except OSError as e:
            self._remove(tmp)
            self._error("write", e, path.name)
            if e.errno == errno.EISDIR:
                self._blocked.add(key)
            self._write_failed(e)
            return False
        self._write_failures = 0
        return True

    def _write_failed(self, err: OSError) -> None:
        if err.errno == errno.ENOENT and self._dir_gone():
            self._switch_off("its directory is gone")
            return
        if err.errno not in _STORAGE_ERRNOS:
            return
        self._write_failures += 1
        if self._write_failures >= FAILURES_TO_DEGRADE and self.state == TierState.READ_WRITE:
            self.state = TierState.READ_ONLY
            log.warning("prefix cache disk tier %s is now read-only after %d failed writes in a row (last: %s); "
                        "entries already on disk are still read", self.dir, self._write_failures, _errno_name(err))

    # ---- reading ---------------------------------------------------------------------------------
    def read(self, key: Key) -> dict[str, torch.Tensor] | None:
        """The entry, or None when it cannot be served: missing or unreadable (forgotten),
        not a regular file (rejected, removed when it can be), truncated or corrupt (removed)."""
        if self.state == TierState.OFF:
            return None
        path = self.path(key)
        try:
            if not stat.S_ISREG(os.lstat(path).st_mode):
                return self._reject(key, "is not a regular file")
            fd = os.open(path, _READ_FLAGS)
            try:
                if not stat.S_ISREG(os.fstat(fd).st_mode):
                    return self._reject(key, "is not a regular file")
                blob = _read_all(fd)
            finally:
                os.close(fd)
        except OSError as e:
            self.forget(key)
            self._error("read", e, path.name)
            self._read_failed(e)
            return None
        self._read_failures = 0
        digest, payload = blob[:DIGEST], blob[DIGEST:]
        try:
            if len(blob) <= DIGEST or hashlib.blake2b(payload, digest_size=DIGEST).digest() != digest:
                raise ValueError("checksum mismatch")
            return st_load(payload)
        except Exception:
            with self._lock:
                self.counters["disk_corrupt"] += 1
            self.discard(key)
            return None

    def _read_failed(self, err: OSError) -> None:
        if err.errno == errno.ENOENT and self._dir_gone():
            self._switch_off("its directory is gone")
            return
        if err.errno != errno.EIO:
            return
        self._read_failures += 1
        if self._read_failures >= FAILURES_TO_DEGRADE:
            self._switch_off(f"{self._read_failures} reads in a row failed with EIO")

    def _reject(self, key: Key, why: str) -> None:
        """Something other than a regular file holds an entry's name: forget the key, remove the
        thing if it can be (a directory cannot: then never write that name again)."""
        name = self.path(key).name
        with self._lock:
            self.counters["disk_rejected"] += 1
        self._log.warning("rejected", f"prefix cache disk tier: {name} {why}; ignored")
        self.forget(key)
        if not self._remove(self.path(key)):
            self._blocked.add(key)

    # ---- removing --------------------------------------------------------------------------------
    def forget(self, key: Key) -> None:
        """Drop ``key`` from the index (the lookup no longer finds it); the file is left alone."""
        with self._lock:
            size = self._index.pop(key, None)
            if size is not None:
                self.used -= size

    def discard(self, key: Key) -> None:
        self.forget(key)
        self._remove(self.path(key))

    def _remove(self, path: Path) -> bool:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
        except OSError as e:
            self._error("remove", e, path.name)
            return False
        return True

    # ---- faults ----------------------------------------------------------------------------------
    def _error(self, op: str, err: OSError, what: str) -> None:
        name = _errno_name(err)
        with self._lock:
            self.counters[f"disk_errors_{op}"] += 1
        self._log.warning(f"{op} {name}", f"prefix cache disk tier: {op} of {what} failed "
                                          f"({name}: {err.strerror}); skipped, served without it")

    def _dir_gone(self) -> bool:
        try:
            return not stat.S_ISDIR(os.stat(self.dir).st_mode)
        except OSError:
            return True

    def _switch_off(self, why: str) -> None:
        with self._lock:
            if self.state == TierState.OFF:
                return
            self.state = TierState.OFF
            self._index.clear()
            self.used = 0
        log.warning("prefix cache disk tier %s is off: %s; serving continues from the pool and host tier",
                    self.dir, why)


def _read_all(fd: int) -> bytes:
    chunks = []
    while chunk := os.read(fd, 1 << 20):
        chunks.append(chunk)
    return b"".join(chunks)
