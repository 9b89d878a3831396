"""Indexer top-k selection (issue 22): topk with exact tie resolution and the triangular prefill
blocking select exactly what a stable descending sort of every pool's score selected.

Inputs are small integers and the scale a power of two, so every score is exact whatever the
matmul blocking: ties are real ties (zeros from the ReLU, repeated keys), and any difference is
a selection difference. -0.0 (which must tie with 0.0) is covered on raw scores."""

from __future__ import annotations

import pytest
import torch

from flashlane.kernels import indexer
from flashlane.kernels.indexer import (_select_group, _top_pools, _top_pools_prefill, select_positions,
                                       select_positions_decode)
from flashlane.kernels.native import index_scores as native_index_scores
from flashlane.kernels.native import top_pools as native_top_pools
from flashlane.kernels.paged import pooled_rows

SCALE = 0.25


def sort_select(q, w, keys, visible_pools, query_pos, *, topk, kpool, select_tail, scale):
    """The selection as it was before issue 22: a stable descending sort of all M pools per query."""
    g, s = q.shape[:2]
    m = keys.shape[1]
    n_sel = min(topk // kpool, m)
    parts = []
    if n_sel > 0:
        scores = indexer._score_pools(q, w, keys, scale)
        selectable = torch.arange(m) < visible_pools[..., None]
        scores = scores.masked_fill(~selectable, float("-inf"))
        order = torch.sort(scores, dim=-1, descending=True, stable=True).indices[..., :n_sel]
        ok = selectable.gather(-1, order)
        tok = order[..., None] * kpool + torch.arange(kpool)
        parts.append(tok.masked_fill(~ok[..., None], -1).flatten(-2))
    if n_sel * kpool < topk:
        parts.append(torch.full((g, s, topk - n_sel * kpool), -1, dtype=torch.long))
    if select_tail and kpool > 1:
        visible = query_pos + 1
        r = visible % kpool
        j = torch.arange(kpool - 1)
        parts.append(((visible - r)[..., None] + j).masked_fill(j >= r[..., None], -1))
    return torch.cat(parts, dim=-1)


def tie_heavy(g, s, m, *, heads=2, dim=4, seed=0):
    """q [g, s, heads, dim], w [g, s, heads], keys [g, m, dim] in small integers: few distinct
    keys, zero keys and zero queries, so most queries have long runs of equal scores."""
    gen = torch.Generator().manual_seed(seed)

    def ints(*shape):
        return torch.randint(-2, 3, shape, generator=gen).float()

    q, w = ints(g, s, heads, dim), ints(g, s, heads)
    q[:, ::5] = 0.0
    keys = ints(3, dim)[torch.randint(0, 3, (g, m), generator=gen)]
    keys[:, ::7] = 0.0
    return q, w, keys


def test_tie_heavy_inputs_have_zero_runs_ties_and_positive_scores():
    q, w, keys = tie_heavy(1, 40, 50)
    scores = indexer._score_pools(q, w, keys, SCALE)
    zero = scores == 0
    assert zero.float().mean() > 0.2 and (scores > 0).any()
    # besides zeros, most queries repeat their largest score
    assert (scores == scores.amax(-1, keepdim=True)).sum(-1).gt(1).float().mean() > 0.5


@pytest.mark.parametrize("n", [1, 3, 8, 24])
def test_top_pools_is_the_head_of_a_stable_descending_sort(n):
    gen = torch.Generator().manual_seed(n)
    values = torch.tensor([float("-inf"), -1.0, -0.0, 0.0, 0.5, 2.0])
    x = values[torch.randint(0, len(values), (2, 30, 24), generator=gen)]
    x[0, 0] = 0.0                                               # a row of nothing but ties
    x[0, 1] = float("-inf")
    want = torch.sort(x, dim=-1, descending=True, stable=True).indices[..., :n]
    assert torch.equal(_top_pools(x, n), want)
    if native_top_pools.unavailable() is None:        # the prefill kernel's radix select
        assert torch.equal(native_top_pools.top_pools(x, n), want)


@pytest.mark.parametrize("n", [1, 4, 5, 40])
def test_prefill_top_pools_fast_and_exact_rows(n):
    """Rows whose cut falls between distinct scores (one topk) and rows where a tie straddles it
    (the exact path), in one call; ties above the cut must still come out lower index first."""
    gen = torch.Generator().manual_seed(n)
    distinct = torch.randn(6, 40, generator=gen)
    # a tie run above a unique cut: [3, 3, 3, 3, 2, 1, 1, ...] shuffled
    above = torch.tensor([3.0] * 4 + [2.0] + [1.0] * 35)[torch.stack([torch.randperm(40, generator=gen)
                                                                      for _ in range(6)])]
    ties = torch.tensor([0.0, -0.0, 1.0, float("-inf")])[torch.randint(0, 4, (6, 40), generator=gen)]
    x = torch.cat([distinct, above, ties])[None]
    want = torch.sort(x, dim=-1, descending=True, stable=True).indices[..., :n]
    assert torch.equal(_top_pools_prefill(x, n), want)
    if native_top_pools.unavailable() is None:
        assert torch.equal(native_top_pools.top_pools(x, n), want)


@pytest.mark.skipif(native_top_pools.unavailable() is not None, reason="native kernels unavailable on this CPU")
@pytest.mark.parametrize("scale", [1e-30, 1e-3, 1.0, 1e20])
def test_native_prefill_top_pools_equals_the_stable_sort_on_wide_rows(scale):
    """Rows wider than the radix histogram resolves (many scores per bucket, runs of equal ones,
    both signs, masked tails), split over threads: the head of a stable descending sort."""
    gen = torch.Generator().manual_seed(int(-torch.log10(torch.tensor(scale))) + 40)
    x = torch.randn(300, 3000, generator=gen) * scale
    x[:, ::5] = x[:, 1::5]                                       # equal pairs
    x[::3, 2000:] = float("-inf")                                # masked past the visible pools
    x[7] = 0.0
    x[8, :] = -0.0
    x[8, ::2] = 0.0
    for n in (1, 64, 999, 3000):
        want = torch.sort(x, dim=-1, descending=True, stable=True).indices[..., :n]
        assert torch.equal(native_top_pools.top_pools(x, n), want)
        assert torch.equal(native_top_pools.top_pools(x.view(3, 100, 3000), n), want.view(3, 100, n))


@pytest.mark.skipif(native_top_pools.unavailable() is not None, reason="native kernels unavailable on this CPU")
@pytest.mark.parametrize("m", [4096, 12289])
def test_native_top_pools_sampled_threshold_rows_equal_the_stable_sort(m):
    """Rows wide enough for the sampled threshold (a strided sample picks a value about 4n scores
    reach; one pass collects them), on every case that threshold can meet: a run of equal
    scores at the cut as wide as a quarter of the row (a query whose ReLU'd heads vanish scores
    0 on many pools), all scores tied, a row whose top is a few far outliers the sample misses
    (fewer than n reach the threshold: the radix select), masked tails of -inf, only a few
    finite scores, -0.0 tying with 0.0, and exact ties in pairs."""
    gen = torch.Generator().manual_seed(m)
    x = torch.randn(64, m, generator=gen)
    x[:, : m - 1 : 5] = x[:, 1::5]                                # equal pairs
    x[0] = torch.where(x[0] > 0, 0.0, x[0])                       # zeros are the top: half the row ties at the cut
    x[1] = torch.where(torch.rand(m, generator=gen) < 0.25, 0.0, -x[1].abs())   # a quarter zeros, the rest below
    x[1, ::2] = torch.where(x[1, ::2] == 0, -0.0, x[1, ::2])
    x[2] = 3.0                                                    # all tied
    x[3] = -torch.arange(m, dtype=torch.float32)                  # distinct, descending
    x[4, : m // 2] = float("-inf")                                # masked half
    x[5, 10:] = float("-inf")                                     # fewer finite than n
    x[6] = -1.0
    x[6, 1 + torch.randperm(m - 1, generator=gen)[:40]] = 5.0     # 40 outliers: between n = 32 and 64
    x[7, 3::1000] = 1e30                                          # outliers the strided sample misses
    x[8:16] *= 1e-30
    x[16:24, -(m // 3):] = float("-inf")
    for n in (1, 32, 64, 100):
        want = torch.sort(x, dim=-1, descending=True, stable=True).indices[..., :n]
        assert torch.equal(native_top_pools.top_pools(x, n), want), n


def prefill_case(start, s, kpool, seed):
    ctx = start + s
    m = ctx // kpool
    q, w, keys = tie_heavy(1, s, m, seed=seed)
    pos = torch.arange(start, ctx)[None]
    return q, w, keys, (pos + 1) // kpool, pos


@pytest.mark.parametrize("kpool,topk,tail", [(1, 8, False), (1, 24, False), (4, 8, True), (4, 8, False),
                                             (4, 40, True), (4, 400, True)])
@pytest.mark.parametrize("score_block", [1, 37, 1 << 24])
@pytest.mark.parametrize("start", [0, 29])
def test_prefill_selection_equals_sort_selection(monkeypatch, kpool, topk, tail, score_block, start):
    """Chunks starting at 0 and mid-sequence; topk 40 / 400 with kpool 4 ask for more pools than
    the early queries see (400: more than the context holds); block 1 = one query per block."""
    monkeypatch.setattr(indexer, "_SCORE_BLOCK", score_block)
    case = prefill_case(start, 45, kpool, seed=start + kpool)
    opts = dict(topk=topk, kpool=kpool, select_tail=tail, scale=SCALE)
    assert torch.equal(_select_group(*case, **opts), sort_select(*case, **opts))


def test_prefill_blocks_score_only_the_visible_pools(monkeypatch):
    scored = []
    real = indexer._score_pools

    def spy(q, w, keys, scale):
        scored.append((q.shape[1], keys.shape[1]))
        return real(q, w, keys, scale)

    monkeypatch.setattr(indexer, "_score_pools", spy)
    monkeypatch.setattr(indexer, "_SCORE_BLOCK", 2 * 160)       # heads * queries * pools
    _select_group(*prefill_case(0, 64, 1, seed=3), topk=4, kpool=1, select_tail=False, scale=SCALE)
    assert scored[0] == (12, 12)                                # 12 * 12 <= 160 < 13 * 13
    at = 0
    for n, pools in scored:
        at += n
        assert pools == at                                      # query at position p sees p + 1 pools
        assert n * pools <= 160 or n == 1
    assert at == 64


@pytest.mark.parametrize("kpool,topk,tail", [(1, 8, False), (4, 8, True), (4, 40, False)])
def test_prefill_groups_with_unordered_visibility(monkeypatch, kpool, topk, tail):
    """Several sequences per group, visible counts not ascending (the blocks take the running max)."""
    monkeypatch.setattr(indexer, "_SCORE_BLOCK", 2 * 2 * 3 * 10)
    q, w, keys = tie_heavy(2, 20, 12, seed=7)
    pos = torch.randint(0, 12 * kpool, (2, 20), generator=torch.Generator().manual_seed(7))
    case = (q, w, keys, (pos + 1) // kpool, pos)
    opts = dict(topk=topk, kpool=kpool, select_tail=tail, scale=SCALE)
    assert torch.equal(_select_group(*case, **opts), sort_select(*case, **opts))


@pytest.mark.parametrize("kpool,topk,tail", [(1, 8, False), (1, 64, False), (4, 8, True), (4, 12, False)])
def test_decode_selection_equals_sort_selection(kpool, topk, tail):
    """One query per sequence, every addressable pool scored, positions anywhere (0 included)."""
    m = 24
    q, w, keys = tie_heavy(6, 1, m, seed=kpool + topk)
    pos = torch.tensor([0, 1, 5, 30, m * kpool - 1, 2])[:, None]
    case = (q, w, keys, (pos + 1) // kpool, pos)
    opts = dict(topk=topk, kpool=kpool, select_tail=tail, scale=SCALE)
    assert torch.equal(_select_group(*case, **opts), sort_select(*case, **opts))


@pytest.mark.parametrize("kpool,topk,tail", [(1, 8, False), (4, 8, True), (4, 16, False)])
def test_select_positions_through_the_paged_pool(monkeypatch, kpool, topk, tail):
    """The public functions on scattered pages: a mixed batch (two prefill chunks, two decode
    rows) and a decode-only batch through select_positions_decode, against the sort selection."""
    monkeypatch.setattr(indexer, "_SCORE_BLOCK", 200)
    page, pages_per_seq, heads, dim = 8, 8, 2, 4
    n_seqs = 4
    order = torch.randperm(n_seqs * pages_per_seq, generator=torch.Generator().manual_seed(1)) + 1
    tables = order.view(n_seqs, pages_per_seq)
    index_keys = torch.zeros((1 + n_seqs * pages_per_seq) * page // kpool, dim)
    seq_keys = []
    for b in range(n_seqs):
        _, _, k = tie_heavy(1, 1, pages_per_seq * page // kpool, dim=dim, seed=10 + b)
        rows = pooled_rows(tables, torch.tensor([b]), torch.arange(k.shape[1])[None], page, kpool)
        index_keys[rows[0]] = k[0]
        seq_keys.append(k)

    def reference(b, qb, wb, pos):
        ctx = int(pos[-1]) + 1
        return sort_select(qb[None], wb[None], seq_keys[b][:, :ctx // kpool], ((pos + 1) // kpool)[None],
                           pos[None], topk=topk, kpool=kpool, select_tail=tail, scale=SCALE)[0]

    q_lens, starts = [30, 1, 17, 1], [0, 40, 9, 63]
    ctx_lens = [s + n for s, n in zip(starts, q_lens)]
    q, w, _ = tie_heavy(1, sum(q_lens), 1, heads=heads, dim=dim, seed=5)
    q, w = q[0], w[0]
    positions = torch.cat([torch.arange(s, c) for s, c in zip(starts, ctx_lens)])
    opts = dict(page_size=page, topk=topk, kpool=kpool, always_select_tail=tail, scale=SCALE)
    kernels = [None]
    if native_top_pools.unavailable() is None:     # the native prefill kernels the cpu backend passes
        kernels.append(indexer.SelectionKernels(native_index_scores.index_scores, native_top_pools.top_pools))
    for top in kernels:
        got = select_positions(q, w, index_keys, positions=positions, q_lens=q_lens, ctx_lens=ctx_lens,
                               block_tables=tables, kernels=top, **opts)
        at = 0
        for b, n in enumerate(q_lens):
            sl = slice(at, at + n)
            assert torch.equal(got[sl], reference(b, q[sl], w[sl], positions[sl])), f"sequence {b}, top {top}"
            at += n

    dec_pos = torch.tensor([3, 40, 0, 63])
    dec = select_positions_decode(q[:n_seqs], w[:n_seqs], index_keys, positions=dec_pos, block_tables=tables,
                                  **opts)
    for b in range(n_seqs):
        assert torch.equal(dec[b], reference(b, q[b:b + 1], w[b:b + 1], dec_pos[b:b + 1])[0]), f"decode {b}"


@pytest.mark.skipif(native_index_scores.unavailable() is not None, reason="native kernels unavailable on this CPU")
@pytest.mark.parametrize("g,s,h,d,m", [(1, 37, 2, 32, 101), (2, 5, 3, 7, 9), (1, 1, 64, 128, 40), (1, 70, 2, 32, 8)])
def test_native_prefill_scores_equal_torchs_to_float32_rounding(g, s, h, d, m):
    """The fused scores (no per-head products in memory) against ``_score_pools``; exact where
    every product and sum is (small integers, a power-of-two scale), as the selection tests use."""
    gen = torch.Generator().manual_seed(s + m)
    q, w, keys = torch.randn(g, s, h, d, generator=gen), torch.randn(g, s, h, generator=gen), torch.randn(
        g, m, d, generator=gen)
    want = indexer._score_pools(q, w, keys, 0.17)
    torch.testing.assert_close(native_index_scores.index_scores(q, w, keys, 0.17), want, rtol=1e-5, atol=1e-5)
    q, w, keys = tie_heavy(g, s, m, heads=h, dim=d, seed=s)
    assert torch.equal(native_index_scores.index_scores(q, w, keys, SCALE), indexer._score_pools(q, w, keys, SCALE))


@pytest.mark.skipif(native_index_scores.unavailable("avx512") is not None,
                    reason="the AVX-512 build needs a CPU with avx512f")
@pytest.mark.parametrize("s,h,d,m", [(37, 2, 32, 101), (6, 3, 7, 33), (9, 2, 32, 5000)])
def test_native_scores_builds_round_alike(s, h, d, m):
    """The AVX-512 build (16 lanes, blocks of 32 pools) and the AVX2 build (8 lanes, blocks of
    16) sum in the same order lane for lane: bit-identical scores, on block-ragged widths."""
    gen = torch.Generator().manual_seed(m)
    q, w, keys = torch.randn(1, s, h, d, generator=gen), torch.randn(1, s, h, generator=gen), torch.randn(
        1, m, d, generator=gen)
    wide = native_index_scores.index_scores(q, w, keys, 0.17, variant="avx512")
    assert native_index_scores._library("avx512").index_scores_block() == 32
    assert native_index_scores._library("avx2").index_scores_block() == 16
    assert torch.equal(wide, native_index_scores.index_scores(q, w, keys, 0.17, variant="avx2"))
    assert native_index_scores.best_variant() == "avx512"


def test_native_scores_variant_follows_the_cpu_flags():
    from flashlane.kernels.cpu_caps import CpuCaps

    avx2_only = CpuCaps("AVX2", frozenset({"avx2", "fma", "f16c"}))
    assert native_index_scores.cpu_unavailable("avx512", avx2_only) == "the CPU lacks avx512f"
    assert native_index_scores.cpu_unavailable("avx2", avx2_only) is None
    assert native_index_scores.cpu_unavailable("avx512", CpuCaps("AVX512", avx2_only.flags | {"avx512f"})) is None
