"""Content keys of full pages: a chained hash, as vLLM does.

The key of page ``i`` covers every token before its end: ``h_i = H(h_{i-1} || tokens of page i)``
with ``h_{-1}`` a fingerprint of the model and cache layout. Two sequences share a key exactly
when they share the whole prefix up to that page boundary, so a key names a prefix, and a state
checkpoint taken at that boundary is stored under the same key. Keys are deterministic
(blake2b, no process-random seed), so a disk tier can be read back after a restart.
"""

from __future__ import annotations

import hashlib
from array import array

DIGEST = 16


def root_key(fingerprint: str) -> bytes:
    return hashlib.blake2b(fingerprint.encode(), digest_size=DIGEST).digest()


def extend_keys(keys: list[bytes], tokens: list[int], page_size: int, root: bytes) -> list[bytes]:
    """Append the keys of every full page of ``tokens`` not yet in ``keys`` (in place)."""
    for i in range(len(keys), len(tokens) // page_size):
        parent = keys[i - 1] if i else root
        page = array("q", tokens[i * page_size:(i + 1) * page_size]).tobytes()
        keys.append(hashlib.blake2b(parent + page, digest_size=DIGEST).digest())
    return keys
