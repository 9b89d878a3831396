"""The cpu backend's dense (llama) attention over the paged pool: a prefill chunk after cached
history attends in two flash calls merged by their log-sum-exps (history unmasked, the chunk
causally) instead of one call under a [Q, T] mask; both must give the same result."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from flashlane.kernels.backends.cpu import dense_attention as dense

needs_split = pytest.mark.skipif(dense._flash is None, reason="this torch has no CPU flash-attention op")


def _batch(q_lens, ctx_lens, page, num_pages, g):
    pages = [-(-c // page) for c in ctx_lens]
    order = torch.randperm(num_pages, generator=g)
    tables, at = [], 0
    for n in pages:
        tables.append(order[at:at + n].tolist() + [0] * (max(pages) - n))
        at += n
    table = torch.tensor(tables)
    slots = []
    for b, (q, c) in enumerate(zip(q_lens, ctx_lens)):
        slots += [table[b, p // page].item() * page + p % page for p in range(c - q, c)]
    cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()])
    return SimpleNamespace(block_tables=table, page_size=page, static=False, q_lens=q_lens, ctx_lens=ctx_lens,
                           ctx_lens_t=torch.tensor(ctx_lens), slot_mapping=torch.tensor(slots), cu_q=cu)


def _attend(q, k, v, pool, meta, split: bool, monkeypatch):
    with monkeypatch.context() as m:
        if not split:
            m.setattr(dense, "_flash", None)        # the plan then builds masks, as without the op
        plan = dense.AttentionPlan(meta)
        assert all((g.mask is None) == split for g in plan.groups if g.start)
        return dense.dense_attention(q, k, v, pool.clone(), None, meta, plan)


@needs_split
@pytest.mark.parametrize("num_heads, num_kv, d", [(9, 3, 64), (4, 4, 16), (6, 1, 8)])
@pytest.mark.parametrize("page", [1, 16])
def test_chunk_after_history_equals_the_masked_call(num_heads, num_kv, d, page, monkeypatch):
    g = torch.Generator().manual_seed(num_heads + d + page)
    # a decode token, a chunk after history, a fresh prompt, a two-token chunk after one token
    q_lens, ctx_lens = [1, 40, 30, 2], [50, 140, 30, 3]
    meta = _batch(q_lens, ctx_lens, page, 4096 // page, g)
    n = sum(q_lens)
    pool = torch.randn(4096, 2 * num_kv * d, generator=g)
    q, k, v = (torch.randn(n, h, d, generator=g) for h in (num_heads, num_kv, num_kv))
    split = _attend(q, k, v, pool, meta, True, monkeypatch)
    masked = _attend(q, k, v, pool, meta, False, monkeypatch)
    torch.testing.assert_close(split, masked, rtol=1e-5, atol=1e-5)
    # bf16 (the dtype auto picks on CPUs with native bf16): within bf16 rounding of float32
    half = _attend(q.bfloat16(), k.bfloat16(), v.bfloat16(), pool.bfloat16(), meta, True, monkeypatch)
    want = _attend(*(t.bfloat16().float() for t in (q, k, v, pool)), meta, False, monkeypatch)
    torch.testing.assert_close(half.float(), want, rtol=2e-2, atol=2e-2)


def test_inside_a_compiled_graph_the_plan_keeps_the_mask(monkeypatch):
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    meta = _batch([5], [20], 16, 8, torch.Generator().manual_seed(0))
    assert dense.AttentionPlan(meta).groups[0].mask is not None
