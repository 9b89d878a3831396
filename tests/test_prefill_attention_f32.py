"""float32 prefill attention straight from the paged pool (``kernels/native/prefill_attention_f32``),
both builds, against SDPA over the gathered history under the causal mask; its split over
threads; what it declines. Llama prefill through it against transformers:
``test_llama_fidelity.test_head_dim_64_prefill_through_the_native_kernel``."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from flashlane.kernels.native import prefill_attention_f32 as f32

AVX512_WHY_NOT = f32.unavailable("avx512")
AVX2_WHY_NOT = f32.unavailable("avx2")
VARIANTS = [
    pytest.param("avx2", marks=pytest.mark.skipif(AVX2_WHY_NOT is not None, reason=f"avx2 build: {AVX2_WHY_NOT}")),
    pytest.param("avx512", marks=pytest.mark.skipif(AVX512_WHY_NOT is not None,
                                                   reason=f"avx512 build: {AVX512_WHY_NOT}")),
]


def _case(heads, kv, d, start, q_len, page, seed=0):
    g = torch.Generator().manual_seed(seed)
    total = start + q_len
    pages = -(-total // page)
    pool = torch.randn((pages + 8) * page, 2 * kv * d, generator=g)
    table = torch.randperm(pages + 8, generator=g)[:pages]
    q = torch.randn(q_len, heads, d, generator=g)
    return q, pool, table


def _reference(q, pool, table, start, kv, page):
    q_len, heads, d = q.shape
    total = start + q_len
    t = torch.arange(total)
    rows = pool[table[t // page] * page + t % page].view(total, 2, kv, d)
    mask = t[None] <= torch.arange(start, total)[:, None]
    out = F.scaled_dot_product_attention(q.transpose(0, 1)[None], rows[:, 0].transpose(0, 1)[None],
                                         rows[:, 1].transpose(0, 1)[None], attn_mask=mask, enable_gqa=True)
    return out[0].transpose(0, 1)


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("heads, kv, d, start, q_len, page", [
    (9, 3, 64, 0, 37, 16),       # a fresh prompt, a partial block of rows and of keys
    (9, 3, 64, 100, 70, 16),     # a chunk after history
    (9, 3, 64, 250, 600, 16),    # several blocks of rows, spans of keys past 256
    (4, 4, 64, 5, 16, 1),        # one query head per kv head, one-token pages
    (8, 2, 128, 300, 129, 4),    # head dim 128: two passes of the values
    (2, 1, 64, 0, 1, 16),        # one token
    (16, 2, 64, 0, 300, 16),     # eight query heads per kv head
    (200, 1, 64, 3, 5, 16),      # more query heads per kv head than a block's rows
])
def test_matches_sdpa_under_the_causal_mask(variant, heads, kv, d, start, q_len, page):
    if heads // kv > 192:
        assert not f32.supports(torch.empty(1, heads, d), torch.empty(1, 2 * kv * d), None, kv, variant)
        return
    q, pool, table = _case(heads, kv, d, start, q_len, page, seed=heads + d + start)
    out = torch.full_like(q, float("nan"))
    got = f32.prefill_attention(q, pool, table, start, kv, page, out, variant=variant)
    assert got is out
    torch.testing.assert_close(out, _reference(q, pool, table, start, kv, page), rtol=1e-5, atol=5e-6)


@pytest.mark.parametrize("variant", VARIANTS)
def test_strided_rows_threads_and_batch_neighbours_do_not_change_a_bit(variant):
    """The chunk's rows as a slice of a larger batch, written into a slice of the output: equal
    bit for bit to the standalone call, on one thread and on two (the blocks split)."""
    q, pool, table = _case(9, 3, 64, 150, 290, 16, seed=4)
    alone = f32.prefill_attention(q, pool, table, 150, 3, 16, torch.empty_like(q), variant=variant)
    big = torch.randn(400, 9, 64)
    big[50:340] = q
    out = torch.zeros_like(big)
    prev = torch.get_num_threads()
    for threads in (1, 2):
        torch.set_num_threads(threads)
        try:
            f32.prefill_attention(big[50:340], pool, table, 150, 3, 16, out[50:340], variant=variant)
        finally:
            torch.set_num_threads(prev)
        assert torch.equal(out[50:340], alone)
        assert not out[:50].any() and not out[340:].any()


def test_inside_a_compiled_graph_it_declines_before_any_cached_lookup(monkeypatch):
    """Dynamo cannot trace a call of an lru_cache wrapper: while compiling, ``supports`` answers
    before it asks which build runs."""
    def untraceable(*a):
        raise AssertionError("looked up a build while compiling")
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    monkeypatch.setattr(f32, "best_variant", untraceable)
    monkeypatch.setattr(f32, "unavailable", untraceable)
    assert not f32.supports(torch.randn(4, 2, 64), torch.randn(64, 256), None, 2)


@pytest.mark.parametrize("variant", VARIANTS)
def test_a_row_gives_the_same_bits_however_the_prompt_is_chunked(variant):
    """A query row's spans of keys start at key 0 whatever chunk it is in, and keys past its
    position add exact zeros: a prompt prefilled whole and in chunks after cached history (a
    prefix-cache hit, a chunked prefill) gives the same bits (torch's two flash parts merged did
    not)."""
    q, pool, table = _case(9, 3, 64, 0, 700, 16, seed=9)
    whole = f32.prefill_attention(q, pool, table, 0, 3, 16, torch.empty_like(q), variant=variant)
    parts = [f32.prefill_attention(q[a:b], pool, table, a, 3, 16, torch.empty_like(q[a:b]), variant=variant)
             for a, b in [(0, 100), (100, 357), (357, 358), (358, 700)]]
    assert torch.equal(whole, torch.cat(parts))


@pytest.mark.parametrize("variant", VARIANTS)
def test_what_it_declines(variant):
    q = torch.randn(4, 2, 64)
    pool = torch.randn(64, 256)
    assert f32.supports(q, pool, None, 2, variant)
    assert not f32.supports(q.bfloat16(), pool.bfloat16(), None, 2, variant)          # bf16
    assert not f32.supports(q, pool, torch.ones(64), 2, variant)                      # int8 pool scales
    assert not f32.supports(torch.randn(4, 2, 48), pool, None, 2, variant)            # head dim 48
    assert not f32.supports(torch.randn(4, 2, 512), pool, None, 2, variant)           # past 256
    assert not f32.supports(torch.randn(4, 64, 2).transpose(1, 2), pool, None, 2, variant)
    assert not f32.supports(torch.randn(4, 3, 64), pool, None, 2, variant)            # 3 heads over 2 kv heads
    assert not f32.supports(q.requires_grad_(), pool, None, 2, variant)               # autograd
    assert f32.supports(torch.randn(4, 2, 96), pool, None, 2, variant) == (variant == "avx2")
    with pytest.raises(ValueError, match="does not take"):
        f32.prefill_attention(torch.randn(4, 2, 48), pool, torch.arange(4), 0, 2, 16, torch.empty(4, 2, 48),
                              variant=variant)
