"""Sparse MLA in its two forms (kernels/sparse_mla.py absorbed, kernels/sparse_mla_expanded.py
expanded): they agree on mixed steps, and the cost rule picks the form per step."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from flashlane.kernels import kv_store, sparse_mla_expanded
from flashlane.kernels.backends import CpuBackend
from flashlane.kernels.sparse_mla_expanded import mla_form_flops, prefer_expanded

PAGE = 4


def _step(q_lens, ctx_lens, *, heads=3, c=8, r=4, dn=6, dv=5, topk=6, groups=None, seed=0):
    """A random mixed step over a paged latent pool: queries, w_kv, pool (int8 with ``groups``)
    and each query's selection, a random duplicate-free subset of the positions up to its own
    (fewer than ``topk`` early in a sequence, then padded with -1), in random order."""
    g = torch.Generator().manual_seed(seed)
    n = sum(q_lens)
    pages = [(ctx + PAGE - 1) // PAGE for ctx in ctx_lens]
    width = max(pages)
    perm = (torch.randperm(sum(pages), generator=g) + 1).tolist()      # page 0 is the null page
    tables = torch.zeros(len(q_lens), width, dtype=torch.long)
    for b, p in enumerate(pages):
        tables[b, :p] = torch.tensor(perm[:p])
        perm = perm[p:]
    rows = (1 + sum(pages)) * PAGE
    values = torch.randn(rows, c + r, generator=g)
    if groups is None:
        latent, scale = values, None
    else:
        latent = torch.zeros(rows, c + r, dtype=torch.int8)
        scale = torch.zeros(rows, groups)
        kv_store.write_rows(latent, scale, torch.arange(rows), values)
    sel = torch.full((n, topk), -1, dtype=torch.long)
    seq, cu = [], [0]
    for b, (ql, ctx) in enumerate(zip(q_lens, ctx_lens)):
        for j in range(ql):
            pos = ctx - ql + j
            pick = torch.randperm(pos + 1, generator=g)[:topk]
            sel[cu[-1] + j, torch.randperm(topk, generator=g)[: len(pick)]] = pick
        seq += [b] * ql
        cu.append(cu[-1] + ql)
    meta = SimpleNamespace(static=False, q_lens=list(q_lens), ctx_lens=list(ctx_lens), cu_q=torch.tensor(cu),
                           seq_of_token=torch.tensor(seq), block_tables=tables, page_size=PAGE)
    q_nope = torch.randn(n, heads, dn, generator=g)
    q_rope = torch.randn(n, heads, r, generator=g) if r else None
    w_kv = torch.randn(heads, dn + dv, c, generator=g) * 0.3
    return q_nope, q_rope, latent, scale, sel, meta, w_kv


def _both(monkeypatch, step, scale=0.3):
    q_nope, q_rope, latent, lscale, sel, meta, w_kv = step
    ops = CpuBackend()
    run = lambda: ops.sparse_mla(q_nope, q_rope, latent, lscale, sel, meta, scale=scale, w_kv=w_kv)
    _force(monkeypatch, expanded=False)
    absorbed = run()
    _force(monkeypatch, expanded=True)
    expanded = run()
    return absorbed, expanded


def _force(monkeypatch, *, expanded: bool):
    """The rule picks the expanded form for every prefill step (or never)."""
    for path in ("EXPANDED_DENSE_FLOP_COST", "EXPANDED_GATHERED_FLOP_COST"):
        monkeypatch.setattr(sparse_mla_expanded, path, 0.0 if expanded else float("inf"))


def _reference(q_nope, q_rope, latent, lscale, sel, meta, w_kv, scale):
    """Per query and head, head-space attention over its selection, written out plainly."""
    dn = q_nope.shape[-1]
    c = w_kv.shape[-1]
    values = latent if lscale is None else kv_store.dequantize_int8(latent, lscale, torch.float32)
    out = torch.zeros(q_nope.shape[0], q_nope.shape[1], w_kv.shape[1] - dn)
    for i in range(q_nope.shape[0]):
        b = int(meta.seq_of_token[i])
        pos = [p for p in sel[i].tolist() if p >= 0]
        if not pos:
            continue
        rows = [int(meta.block_tables[b, p // PAGE]) * PAGE + p % PAGE for p in pos]
        kv = values[rows]
        for h in range(q_nope.shape[1]):
            up = kv[:, :c] @ w_kv[h].t()
            s = up[:, :dn] @ q_nope[i, h]
            if q_rope is not None:
                s = s + kv[:, c:] @ q_rope[i, h]
            out[i, h] = torch.softmax(s * scale, 0) @ up[:, dn:]
    return out


@pytest.mark.parametrize("case", [
    # ragged prefill chunks beside decode tokens; early chunks select fewer than topk
    {"q_lens": [5, 1, 7, 1, 3], "ctx_lens": [5, 9, 12, 3, 30]},
    # long contexts: more distinct rows than topk, and no rope
    {"q_lens": [9, 1, 16], "ctx_lens": [40, 41, 64], "r": 0, "seed": 1},
    # a quantised (int8) latent pool
    {"q_lens": [6, 1, 11], "ctx_lens": [6, 20, 35], "groups": 2, "seed": 2},
])
@pytest.mark.parametrize("dense_rows_per_topk", [1, 1000])   # 1: chunks with d > topk gather; 1000: all dense
def test_both_forms_agree_on_mixed_steps(monkeypatch, case, dense_rows_per_topk):
    monkeypatch.setattr(sparse_mla_expanded, "DENSE_ROWS_PER_TOPK", dense_rows_per_topk)
    step = _step(**case)
    absorbed, expanded = _both(monkeypatch, step)
    torch.testing.assert_close(expanded, absorbed, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(absorbed, _reference(*step, 0.3), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dense_rows_per_topk", [1, 1000])
def test_the_expanded_form_runs_both_attention_paths_and_small_blocks(monkeypatch, dense_rows_per_topk):
    # 1: one sequence with d <= topk (dense), one with d > topk (gathered); 1000: both dense.
    # Queries in blocks of one.
    step = _step([4, 12], [4, 50], topk=5, seed=3)
    monkeypatch.setattr(sparse_mla_expanded, "DENSE_ROWS_PER_TOPK", dense_rows_per_topk)
    monkeypatch.setattr(sparse_mla_expanded, "_GATHER_BLOCK", 1)
    absorbed, expanded = _both(monkeypatch, step)
    torch.testing.assert_close(expanded, absorbed, rtol=1e-5, atol=1e-5)


def test_a_query_with_nothing_selected_gets_zeros(monkeypatch):
    step = _step([4, 1], [10, 6], seed=4)
    step[4][1] = -1
    step[4][4] = -1     # the decode token
    absorbed, expanded = _both(monkeypatch, step)
    assert absorbed[[1, 4]].abs().max() == 0 and expanded[[1, 4]].abs().max() == 0
    torch.testing.assert_close(expanded, absorbed, rtol=1e-5, atol=1e-5)


def test_the_backend_follows_the_rule(monkeypatch):
    calls = []
    real = sparse_mla_expanded.sparse_mla_expanded
    monkeypatch.setattr("flashlane.kernels.backends.cpu.backend.sparse_mla_expanded",
                        lambda *a, **k: calls.append(k["spans"]) or real(*a, **k))
    q_nope, q_rope, latent, lscale, sel, meta, w_kv = _step([5, 1, 3], [5, 9, 20])
    ops = CpuBackend()
    _force(monkeypatch, expanded=True)
    ops.sparse_mla(q_nope, q_rope, latent, lscale, sel, meta, scale=0.3, w_kv=w_kv)
    assert calls == [[(0, 5, 0), (6, 9, 2)]]          # the decode token (flat row 5) is not in a span
    decode = _step([1, 1], [7, 3])
    ops.sparse_mla(*decode[:5], decode[5], scale=0.3, w_kv=decode[6])
    _force(monkeypatch, expanded=False)
    ops.sparse_mla(q_nope, q_rope, latent, lscale, sel, meta, scale=0.3, w_kv=w_kv)
    assert len(calls) == 1


# GLM-5 MLA shape: 64 heads, latent 512, rope 64, nope 192, v 256, top-2048 selection
GLM5 = {"heads": 64, "kv_rank": 512, "rope_dim": 64, "nope_dim": 192, "v_dim": 256, "topk": 2048}


@pytest.mark.parametrize("dense_rows_per_topk", [1, 16])
def test_the_rule_picks_absorbed_for_decode_and_tiny_chunks_and_expanded_for_a_big_chunk(monkeypatch,
                                                                                          dense_rows_per_topk):
    # plain FLOPs (the measured per-path weights are this CPU's, not the rule's logic)
    monkeypatch.setattr(sparse_mla_expanded, "EXPANDED_DENSE_FLOP_COST", 1.0)
    monkeypatch.setattr(sparse_mla_expanded, "EXPANDED_GATHERED_FLOP_COST", 1.0)
    monkeypatch.setattr(sparse_mla_expanded, "DENSE_ROWS_PER_TOPK", dense_rows_per_topk)
    assert not prefer_expanded([], **GLM5)                       # a decode-only step has no chunks
    assert not prefer_expanded([(2, 10_000)], **GLM5)            # a tiny chunk at a long context
    assert not prefer_expanded([(1, 10_000)], **GLM5)            # even if asked about one token
    assert prefer_expanded([(2048, 2048)], **GLM5)               # a big chunk: rows shared by many queries
    assert prefer_expanded([(2048, 2048), (2, 10_000)], **GLM5)  # summed over the step's chunks
    monkeypatch.setattr(sparse_mla_expanded, "EXPANDED_DENSE_FLOP_COST", 10.0)
    monkeypatch.setattr(sparse_mla_expanded, "EXPANDED_GATHERED_FLOP_COST", 10.0)
    assert not prefer_expanded([(2048, 2048)], **GLM5)           # the measured weights move the choice


def test_form_flops_follow_the_docstring_counts(monkeypatch):
    monkeypatch.setattr(sparse_mla_expanded, "DENSE_ROWS_PER_TOPK", 2)
    shape = {"heads": 2, "kv_rank": 8, "rope_dim": 4, "nope_dim": 6, "v_dim": 5, "topk": 7}
    a, e = mla_form_flops(3, 20, **shape)                # gathered: K rows per query
    assert a == 2 * 3 * 2 * (6 * 8 + 7 * (2 * 8 + 4) + 8 * 5)
    assert e == 2 * (20 * 2 * 8 * (6 + 5) + 3 * 2 * 7 * (6 + 4 + 5))
    _, e_dense = mla_form_flops(3, 10, **shape)          # dense: all d rows per query
    assert e_dense == 2 * (10 * 2 * 8 * (6 + 5) + 3 * 2 * 10 * (6 + 4 + 5))
