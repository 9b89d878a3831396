"""The cpu backend's dense (llama) attention over the paged pool: a prefill chunk after cached
history attends in two flash calls merged by their log-sum-exps (history unmasked, the chunk
causally) instead of one call under a [Q, T] mask; both must give the same result."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from flashlane.kernels.backends.cpu import dense_attention as dense
from flashlane.kernels.native import attention_merge, paged_attention

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


def _attend(q, k, v, pool, meta, split: bool, monkeypatch, native: bool = False):
    with monkeypatch.context() as m:
        if not split:
            m.setattr(dense, "_flash", None)        # the plan then builds masks, as without the op
        plan = dense.AttentionPlan(meta)
        assert all((g.mask is None) == split for g in plan.groups if g.start)
        return dense.dense_attention(q, k, v, pool.clone(), None, meta, plan, native)


MERGE_WHY_NOT = attention_merge.unavailable() or paged_attention.unavailable()


@needs_split
@pytest.mark.parametrize("num_heads, num_kv, d", [(9, 3, 64), (4, 4, 16), (6, 1, 8), (2, 2, 12)])
@pytest.mark.parametrize("page", [1, 16])
@pytest.mark.parametrize("native", [False, pytest.param(True, marks=pytest.mark.skipif(
    MERGE_WHY_NOT is not None, reason=f"native kernels unavailable: {MERGE_WHY_NOT}"))])
def test_chunk_after_history_equals_the_masked_call(num_heads, num_kv, d, page, native, monkeypatch):
    """Torch's merge of the two parts or the native one (``native``: also the decode rows read in
    place), float32 and bf16."""
    g = torch.Generator().manual_seed(num_heads + d + page)
    # a decode token, a chunk after history, a fresh prompt, a two-token chunk after one token
    q_lens, ctx_lens = [1, 40, 30, 2], [50, 140, 30, 3]
    meta = _batch(q_lens, ctx_lens, page, 4096 // page, g)
    n = sum(q_lens)
    pool = torch.randn(4096, 2 * num_kv * d, generator=g)
    q, k, v = (torch.randn(n, h, d, generator=g) for h in (num_heads, num_kv, num_kv))
    split = _attend(q, k, v, pool, meta, True, monkeypatch, native)
    masked = _attend(q, k, v, pool, meta, False, monkeypatch)
    torch.testing.assert_close(split, masked, rtol=1e-5, atol=1e-5)
    # bf16 (the dtype auto picks on CPUs with native bf16): within bf16 rounding of float32
    half = _attend(q.bfloat16(), k.bfloat16(), v.bfloat16(), pool.bfloat16(), meta, True, monkeypatch, native)
    want = _attend(*(t.bfloat16().float() for t in (q, k, v, pool)), meta, False, monkeypatch)
    torch.testing.assert_close(half.float(), want, rtol=2e-2, atol=2e-2)


def test_inside_a_compiled_graph_the_plan_keeps_the_mask(monkeypatch):
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    meta = _batch([5], [20], 16, 8, torch.Generator().manual_seed(0))
    assert dense.AttentionPlan(meta).groups[0].mask is not None


@pytest.mark.skipif(attention_merge.unavailable() is not None, reason=f"{attention_merge.unavailable()}")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_native_merge_equals_the_log_sum_exp_formula_in_any_layout(dtype):
    """Flash outputs come [B, H, Q, D] over a [B, Q, H, D] buffer and their log-sum-exps
    [B, H, Q] over [B, Q, H]: the merge keeps the layout and equals the formula in float32 (bf16:
    within one rounding); shapes or dtypes it does not take are None."""
    g = torch.Generator().manual_seed(3)
    b, h, q, d = 2, 3, 5, 20
    o1, o2 = (torch.randn(b, q, h, d, generator=g).to(dtype).transpose(1, 2) for _ in range(2))
    l1, l2 = (4 * torch.randn(b, q, h, generator=g).transpose(1, 2) for _ in range(2))
    got = attention_merge.merge(o1, l1, o2, l2)
    top = torch.maximum(l1, l2)
    w1, w2 = (l1 - top).exp()[..., None], (l2 - top).exp()[..., None]
    want = (o1.float() * w1 + o2.float() * w2) / (w1 + w2)
    assert got.dtype == dtype and got.stride() == o1.stride()
    tol = 1e-6 if dtype == torch.float32 else 2 ** -8
    torch.testing.assert_close(got.float(), want, rtol=tol, atol=tol)
    assert attention_merge.merge(o1.half(), l1, o2.half(), l2) is None
    assert attention_merge.merge(o1, l1, o2.contiguous(), l2) is None or o1.is_contiguous()


def test_the_plan_sums_the_decode_history_once_for_every_layer():
    """Decode groups carry their lengths' sum, which the native kernel's thread split reads
    instead of summing the lengths tensor again in every layer."""
    meta = _batch([1, 40, 1], [50, 140, 7], 16, 64, torch.Generator().manual_seed(1))
    decode = [g for g in dense.AttentionPlan(meta).groups if g.tables is not None]
    assert len(decode) == 1 and decode[0].history == 57 == int(decode[0].lens.sum())
