"""bf16 prefill attention on AMX tiles straight from the paged pool
(``kernels/native/prefill_attention``) against float32 SDPA over the gathered history under the
causal mask; its split over threads; what it declines; and the engine with it against without."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine_models import bf16_copy, preset, random_prompts
from flashlane.engine.llm import LLM
from flashlane.engine.sampling_params import SamplingParams
from flashlane.kernels.backends.cpu import dense_attention
from flashlane.kernels.native import prefill_attention

WHY_NOT = prefill_attention.unavailable()
needs_amx = pytest.mark.skipif(WHY_NOT is not None, reason=f"AMX prefill attention unavailable: {WHY_NOT}")


def _case(heads, kv, d, start, q_len, page, seed=0):
    g = torch.Generator().manual_seed(seed)
    total = start + q_len
    pages = -(-total // page)
    pool = torch.randn((pages + 8) * page, 2 * kv * d, generator=g).bfloat16()
    table = torch.randperm(pages + 8, generator=g)[:pages]
    q = torch.randn(q_len, heads, d, generator=g).bfloat16()
    return q, pool, table


def _reference(q, pool, table, start, kv, page):
    q_len, heads, d = q.shape
    total = start + q_len
    t = torch.arange(total)
    rows = pool[table[t // page] * page + t % page].float().view(total, 2, kv, d)
    mask = t[None] <= torch.arange(start, total)[:, None]
    out = F.scaled_dot_product_attention(q.float().transpose(0, 1)[None], rows[:, 0].transpose(0, 1)[None],
                                         rows[:, 1].transpose(0, 1)[None], attn_mask=mask, enable_gqa=True)
    return out[0].transpose(0, 1)


@needs_amx
@pytest.mark.parametrize("heads, kv, d, start, q_len, page", [
    (9, 3, 64, 0, 37, 16),       # a fresh prompt, a partial last block of rows
    (9, 3, 64, 100, 70, 16),     # a chunk after history that is not a multiple of 64
    (4, 4, 32, 5, 16, 1),        # one-token pages
    (8, 2, 128, 300, 129, 4),    # head dim 128: the values in two passes of 64 columns
    (2, 1, 64, 0, 1, 16),        # one token
    (6, 2, 96, 64, 200, 16),     # head dim 96: a last pass of 32 columns
])
def test_matches_float32_sdpa_under_the_causal_mask(heads, kv, d, start, q_len, page):
    """Within bf16 rounding of float32 attention on the same bf16 values (the probabilities are
    rounded to bf16 before the values' product, as torch's bf16 flash kernel rounds them)."""
    q, pool, table = _case(heads, kv, d, start, q_len, page, seed=heads + d + start)
    out = torch.empty_like(q)
    got = prefill_attention.prefill_attention(q, pool, table, start, kv, page, out)
    assert got is out and out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), _reference(q, pool, table, start, kv, page), rtol=2e-2, atol=2e-2)


@needs_amx
def test_strided_rows_threads_and_batch_neighbours_do_not_change_a_bit():
    """The chunk's rows as a slice of a larger batch, written into a slice of the output: equal
    bit for bit to the standalone call, and with one thread or two (the kv heads split)."""
    q, pool, table = _case(9, 3, 64, 150, 90, 16, seed=4)
    alone = prefill_attention.prefill_attention(q, pool, table, 150, 3, 16, torch.empty_like(q))
    big = torch.randn(200, 9, 64).bfloat16()
    big[50:140] = q
    out = torch.zeros_like(big)
    prev = torch.get_num_threads()
    for threads in (1, 2):
        torch.set_num_threads(threads)
        try:
            prefill_attention.prefill_attention(big[50:140], pool, table, 150, 3, 16, out[50:140])
        finally:
            torch.set_num_threads(prev)
        assert torch.equal(out[50:140], alone)
        assert not out[:50].any() and not out[140:].any()


def test_what_it_declines():
    q = torch.randn(4, 2, 64).bfloat16()
    pool = torch.randn(64, 256).bfloat16()
    assert not prefill_attention.supports(q.float(), pool.float(), None)                 # float32
    assert not prefill_attention.supports(q, pool, torch.ones(64))                       # int8 pool scales
    assert not prefill_attention.supports(torch.randn(4, 2, 48).bfloat16(), pool, None)  # head dim 48
    assert not prefill_attention.supports(torch.randn(4, 2, 256).bfloat16(), pool, None)  # past 128
    assert not prefill_attention.supports(torch.randn(4, 64, 2).bfloat16().transpose(1, 2), pool, None)
    if WHY_NOT is None:
        assert prefill_attention.supports(q, pool, None)


@needs_amx
def test_engine_prefill_through_it_keeps_the_greedy_tokens(monkeypatch):
    """SmolLM2 in bf16, prompts in several chunks and a prefix-cache hit: the kernel runs, and the
    greedy tokens equal torch's flash path's (bf16 noise may flip a rare near-tie: most agree)."""
    m = preset("smollm2-135m")
    base = random_prompts(1, 150, 151, 4000, seed=2)[0]
    prompts = [base + random_prompts(1, 40, 41, 4000, seed=s)[0] for s in range(3)]
    greedy = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    calls = []
    real = prefill_attention.prefill_attention
    monkeypatch.setattr(prefill_attention, "prefill_attention", lambda *a, **k: calls.append(a[3]) or real(*a, **k))
    llm = LLM(bf16_copy(m), max_num_batched_tokens=64)
    got = [llm.generate([p], greedy)[0].token_ids for p in prompts]
    assert calls and max(calls) > 0                       # chunks after history, and a cache hit
    monkeypatch.setattr(dense_attention.prefill_attention, "supports", lambda *a: False)
    n = len(calls)
    plain = LLM(bf16_copy(m), max_num_batched_tokens=64)
    want = [plain.generate([p], greedy)[0].token_ids for p in prompts]
    assert len(calls) == n
    assert sum(a == b for a, b in zip(got, want)) >= 2, (got, want)
