"""PagePool and CheckpointPool rules without a model: sharing, LRU order, consistent eviction."""

from __future__ import annotations

import pytest
import torch

from flashlane.cache_spec import cache_spec
from flashlane.config import parse_config
from flashlane.engine.cache.block_hash import extend_keys, root_key
from flashlane.engine.cache.checkpoints import CheckpointPool
from flashlane.engine.cache.page_pool import PagePool
from flashlane.engine.cache.pools import allocate_pools
from flashlane.engine.cache.snapshots import StateSnapshots
from flashlane.presets import preset_config


def _keys(tokens, page=4, root=b"r"):
    return extend_keys([], tokens, page, root)


def test_keys_chain_the_whole_prefix_and_are_deterministic():
    a = _keys([1, 2, 3, 4, 5, 6, 7, 8])
    b = _keys([1, 2, 3, 4, 5, 6, 7, 9])
    c = _keys([0, 2, 3, 4, 5, 6, 7, 8])
    assert a[0] == b[0] and a[1] != b[1]
    assert a[1] != c[1]                       # same page content, different prefix
    assert a == _keys([1, 2, 3, 4, 5, 6, 7, 8, 9])[:2]
    assert root_key("m") == root_key("m") != root_key("n")


def _register_chain(pool, pages, keys):
    for i, (p, k) in enumerate(zip(pages, keys)):
        assert pool.register(p, k, keys[i - 1] if i else None)


def test_shared_pages_are_ref_counted_and_cached_after_release():
    pool = PagePool(6)
    keys = _keys(list(range(12)))
    pages = pool.allocate(3)
    assert 0 not in pages
    _register_chain(pool, pages, keys)
    assert pool.lookup(keys) == pages
    pool.acquire(pages[:2])                   # a second request hits two of them
    pool.release(pages)
    assert pool.num_used == 2 and pool.num_cached == 1
    pool.release(pages[:2])
    assert pool.num_used == 0 and pool.num_cached == 3 and pool.num_free == 6
    assert not pool.register(pool.allocate(1)[0], keys[0], None)   # one page per key


def test_lru_evicts_deepest_first_and_drops_unreachable_descendants():
    forgotten = []
    pool = PagePool(4, on_forget=forgotten.append)
    keys = _keys(list(range(12)))
    pages = pool.allocate(3)
    _register_chain(pool, pages, keys)
    pool.release(pages)
    (new,) = pool.allocate(2)[1:]              # one truly free page, then an eviction
    assert new == pages[2]                     # the deepest page went first
    assert pool.lookup(keys) == pages[:2]
    pool.release([new])                        # unregistered now: back to the free list
    pool.allocate(2)                           # that free page, then the next-deepest cached one
    assert pool.lookup(keys) == pages[:1]
    # evicting the root of a chain forgets every page after it (nothing could hit them)
    pool2 = PagePool(3, on_forget=forgotten.append)
    pages2 = pool2.allocate(3)
    _register_chain(pool2, pages2, keys)
    pool2.release(pages2[1:])                  # pages 1, 2 cached; page 0 still referenced
    pool2.release(pages2[:1])
    pool2._lru.move_to_end(pages2[1])          # make the root the oldest cached page
    pool2._lru.move_to_end(pages2[2])
    pool2.allocate(1)
    assert pool2.lookup(keys) == [] and pool2.num_cached == 0 and pool2.num_free == 2
    assert set(keys) <= set(forgotten)


def test_release_of_unknown_page_is_an_error():
    pool = PagePool(2)
    with pytest.raises(ValueError, match="not allocated"):
        pool.release([1])
    with pytest.raises(MemoryError):
        pool.allocate(3)


def test_checkpoints_are_bit_exact_and_lru():
    spec = cache_spec(parse_config(preset_config("tiny-flash")), 16)
    cache = allocate_pools(spec, 4, 1 + 2 + 2, torch.float32)
    snaps = StateSnapshots(cache)
    cache.recurrent[:, 1].normal_()
    cache.conv[:, 1].normal_()
    evicted = []
    ckpts = CheckpointPool(snaps, first_row=3, capacity=2, on_evict=lambda k, r: evicted.append(k))
    for k in (b"a", b"b"):
        assert ckpts.save(k, 1)
    ckpts.restore(b"a", 2)                     # touch a: b is now the oldest
    assert torch.equal(cache.recurrent[:, 2], cache.recurrent[:, 1])
    assert torch.equal(cache.conv[:, 2], cache.conv[:, 1])
    ckpts.save(b"c", 1)
    assert evicted == [b"b"] and b"a" in ckpts and b"b" not in ckpts
    exported = snaps.export(2)
    snaps.clear(2)
    snaps.load(exported, 2)
    assert torch.equal(cache.recurrent[:, 2], cache.recurrent[:, 1])
