"""Prefix-cache tiers: a pool that holds one session, the rest in host memory or on disk;
restart on the same disk directory; corrupt files are detected and recomputed; bad flags."""

from __future__ import annotations

import os

import pytest

from flashlane import LLM, SamplingParams

from engine_models import preset, random_prompts

PARAMS = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
TIGHT = dict(num_pages=16, num_slots=2, num_checkpoints=2, max_num_seqs=2)


def _sessions(vocab: int, n: int = 4):
    firsts = random_prompts(n, 70, 90, vocab, seed=71)
    extras = [random_prompts(4, 8, 16, vocab, seed=72 + s) for s in range(n)]
    return firsts, extras


def _run_round_robin(llm, firsts, extras, turns: int = 4):
    """Turn t of every session before turn t + 1 of any: the pool cannot keep them all."""
    prompts = [list(f) for f in firsts]
    outs = [[] for _ in firsts]
    for t in range(turns):
        for s in range(len(firsts)):
            o = llm.generate([prompts[s]], PARAMS)[0]
            outs[s].append(o)
            prompts[s] = prompts[s] + o.token_ids + extras[s][t]
    return outs, prompts


def _ids(outs):
    return [[o.token_ids for o in session] for session in outs]


@pytest.fixture(scope="module", params=["tiny-flash", "tiny-standard"])
def setup(request):
    m = preset(request.param)
    firsts, extras = _sessions(min(m.config.vocab_size, 4000))
    ref, _ = _run_round_robin(LLM(m, dtype="float32", enable_prefix_caching=False), firsts, extras)
    return m, firsts, extras, _ids(ref)


def test_host_tier_serves_what_the_pool_cannot_hold(setup):
    m, firsts, extras, want = setup
    pool_only = LLM(m, dtype="float32", **TIGHT)
    got, _ = _run_round_robin(pool_only, firsts, extras)
    assert _ids(got) == want
    pool_hits = pool_only.engine.stats()["prefix_cache_hits"]

    llm = LLM(m, dtype="float32", host_cache_memory=64 << 20, **TIGHT)
    got, _ = _run_round_robin(llm, firsts, extras)
    assert _ids(got) == want
    stats = llm.engine.stats()
    assert stats["prefix_cache_hits_host"] > 0 and stats["prefix_cache_page_evictions"] > 0
    assert stats["prefix_cache_hits"] > pool_hits
    assert stats["pages_used"] == 0 and stats["slots_used"] == 0
    assert 0 < stats["host_cache_bytes_used"] <= 64 << 20


def test_disk_tier_restart_and_corruption(setup, tmp_path):
    m, firsts, extras, want = setup
    llm = LLM(m, dtype="float32", disk_cache_dir=str(tmp_path), **TIGHT)
    got, next_prompts = _run_round_robin(llm, firsts, extras)
    assert _ids(got) == want
    stats = llm.engine.stats()
    assert stats["prefix_cache_hits_disk"] > 0 and stats["prefix_cache_disk_corrupt"] == 0
    llm.close()                                        # write back what the pool still holds
    files = sorted(p for p in tmp_path.rglob("*.st"))
    assert files

    # a new engine on the same directory hits what the old one stored, from disk
    fresh = LLM(m, dtype="float32", disk_cache_dir=str(tmp_path), **TIGHT)
    ref = LLM(m, dtype="float32", enable_prefix_caching=False)
    out = fresh.generate([next_prompts[0]], PARAMS)[0]
    assert out.num_cached_tokens > 0 and fresh.engine.stats()["prefix_cache_hits_disk"] > 0
    assert out.token_ids == ref.generate([next_prompts[0]], PARAMS)[0].token_ids

    # a flipped byte in every file: detected, skipped, counted; the request recomputes correctly
    for f in tmp_path.rglob("*.st"):
        data = bytearray(f.read_bytes())
        data[len(data) // 2] ^= 0xFF
        f.write_bytes(bytes(data))
    broken = LLM(m, dtype="float32", disk_cache_dir=str(tmp_path), **TIGHT)
    out = broken.generate([next_prompts[1]], PARAMS)[0]
    assert broken.engine.stats()["prefix_cache_disk_corrupt"] > 0
    assert out.num_cached_tokens == 0
    assert out.token_ids == ref.generate([next_prompts[1]], PARAMS)[0].token_ids


def test_other_layout_never_reads_the_disk_tier(setup, tmp_path):
    m, firsts, extras, _ = setup
    first = LLM(m, dtype="float32", disk_cache_dir=str(tmp_path), **TIGHT)
    first.generate([firsts[0]], PARAMS)
    first.close()
    other = LLM(m, dtype="float32", disk_cache_dir=str(tmp_path), page_size=32, **TIGHT)
    assert other.generate([firsts[0]], PARAMS)[0].num_cached_tokens == 0
    assert len({p.parent for p in tmp_path.rglob("*.st")}) == 1      # each layout its own namespace


@pytest.mark.parametrize("kwargs,needle", [
    (dict(checkpoint_share=0), "checkpoint_share"),
    (dict(checkpoint_share=1.5), "checkpoint_share"),
    (dict(checkpoint_share="x"), "checkpoint_share"),
    (dict(host_cache_memory=-1), "host_cache_memory"),
    (dict(host_cache_memory="lots"), "host_cache_memory"),
    (dict(disk_cache_bytes=-5, disk_cache_dir="/tmp/x"), "disk_cache_bytes"),
    (dict(disk_cache_bytes=100), "disk_cache_dir"),
    (dict(host_cache_memory=1 << 20, enable_prefix_caching=False), "enable_prefix_caching"),
])
def test_bad_engine_arguments_name_the_field(kwargs, needle):
    with pytest.raises(ValueError, match=needle):
        LLM(preset("tiny-flash"), dtype="float32", **kwargs)


@pytest.mark.skipif(os.geteuid() == 0, reason="root can write anywhere")
def test_unwritable_disk_dir_is_refused(tmp_path):
    d = tmp_path / "ro"
    d.mkdir()
    d.chmod(0o500)
    with pytest.raises(ValueError, match="disk_cache_dir"):
        LLM(preset("tiny-flash"), dtype="float32", disk_cache_dir=str(d))
