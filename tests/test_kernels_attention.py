"""Attention-side kernels and modules: RoPE, paged addressing, the DSA indexer (per-token and
pooled with tail), sparse absorbed MLA, the MoE router / dispatch, and the DSA layer itself —
each against a direct transcription of the spec and, where practical, the transformers modules."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from flashlane.cache_spec import CacheSpec, cache_spec
from flashlane.config import parse_config
from flashlane.kernels import indexer as indexer_kernel
from flashlane.kernels import sparse_mla as sparse_mla_kernel
from flashlane.kernels.indexer import pool_keys, select_positions, write_index_keys
from flashlane.kernels.moe import grouped_experts, route, swiglu
from flashlane.kernels.paged import paged_rows, pooled_rows
from flashlane.kernels.rope import RopeCache, apply_rope
from flashlane.kernels.sparse_mla import sparse_mla_attention
from flashlane.models.dsa_attention import DSAAttention, Indexer
from flashlane.engine.cache.pools import allocate_pools
from flashlane.models.forward_batch import ForwardBatch
from flashlane.models.layers import MLP, MoE, RMSNorm

from hf_tiny import GLM5_NEXT_TINY_TEXT, glm_moe_dsa_hf_config, make_indexers_tie_free


def gen(seed):
    return torch.Generator().manual_seed(seed)


def randn(*shape, seed=0, std=1.0):
    return torch.randn(*shape, generator=gen(seed)) * std


# ---- RoPE / paging --------------------------------------------------------------------------

def test_rope_matches_hf_interleaved_rope_bitwise():
    from transformers.models.glm_moe_dsa.modeling_glm_moe_dsa import (
        GlmMoeDsaRotaryEmbedding, apply_rotary_pos_emb_interleave)

    cfg = glm_moe_dsa_hf_config()
    pos = torch.tensor([0, 1, 2, 7, 300, 4095, 100_000])
    q, k = randn(len(pos), 3, 8, seed=1), randn(len(pos), 1, 8, seed=2)
    cos, sin = GlmMoeDsaRotaryEmbedding(cfg)(q, pos[None])
    ref_q, ref_k = apply_rotary_pos_emb_interleave(q[None], k[None], cos, sin, unsqueeze_dim=2)
    rope = RopeCache(8, 8_000_000.0, capacity=4)       # forces growth past its capacity
    c, s = rope.cos_sin(pos)
    assert torch.equal(apply_rope(q, c, s), ref_q[0])
    assert torch.equal(apply_rope(k[:, 0], c, s), ref_k[0, :, 0])


def test_rope_is_the_interleaved_complex_rotation():
    x = randn(5, 8, seed=3).double()
    pos = torch.arange(5) * 11
    rope = RopeCache(8, 10_000.0)
    out = apply_rope(x, *[t.double() for t in rope.cos_sin(pos)])
    angle = pos[:, None].double() * (10_000.0 ** (-torch.arange(0, 8, 2).double() / 8))
    z = torch.view_as_complex(x.view(5, 4, 2).contiguous()) * torch.polar(torch.ones_like(angle), angle)
    ref = torch.view_as_real(z)                        # interleaved pairs (re, im)
    assert torch.allclose(out, torch.cat([ref[..., 0], ref[..., 1]], dim=-1), atol=1e-12)
    with pytest.raises(ValueError, match="even"):
        RopeCache(7, 10_000.0)


def test_paged_rows_follow_the_block_table():
    tables = torch.tensor([[3, 1, 0], [2, 5, 4]])
    pos = torch.tensor([[0, 3, 4, 9, -1], [0, 4, 8, 11, 5]])
    rows = paged_rows(tables, torch.tensor([0, 1]), pos, page_size=4)
    assert rows.tolist() == [[12, 15, 4, 1, 0], [8, 20, 16, 19, 21]]
    assert paged_rows(tables, torch.tensor([1, 0]), torch.tensor([5, 2]), 4).tolist() == [21, 14]
    pools = pooled_rows(tables, torch.tensor([1]), torch.tensor([[0, 1, 2, -1]]), page_size=4, kpool=2)
    assert pools.tolist() == [[4, 5, 10, 0]]


# ---- indexer: direct transcription of spec §1.7 / §2 --------------------------------------

def spec_selection(q, w, k, g, ape, *, topk, kpool, tail):
    """Per query of one sequence (no padding): list of selected positions in output order."""
    t_len, _, d = q.shape
    n_pools = t_len // kpool
    kbar = []
    for p in range(n_pools):
        mem = range(p * kpool, p * kpool + kpool)
        if kpool == 1:
            kbar.append(k[p])
            continue
        logits = torch.stack([g[t] + ape[m] for m, t in enumerate(mem)])          # [P, D]
        prob = torch.softmax(logits, dim=0)
        kbar.append(sum(prob[m] * k[t] for m, t in enumerate(mem)))
    out = []
    for t in range(t_len):
        scores = []
        for p in range(n_pools):
            if p * kpool + kpool - 1 <= t:
                s = sum(float(w[t, h]) * max(float(q[t, h] @ kbar[p]) * d ** -0.5, 0.0) for h in range(q.shape[1]))
                scores.append((-s, p))                 # sort: best first, lower pool on ties
        picked = [p for _, p in sorted(scores)[: topk // kpool]]
        row = [p * kpool + m for p in picked for m in range(kpool)]
        row += [-1] * (topk - len(row))
        if tail and kpool > 1:
            c = t + 1
            r = c % kpool
            row += [c - r + j if j < r else -1 for j in range(kpool - 1)]
        out.append(row)
    return out, torch.stack(kbar) if kbar else None


def index_only_spec(kpool, dim, page_size=8):
    return CacheSpec(page_size=page_size, latent_layers=(0,), latent_dim=4, index_layers=(0,),
                     index_row_of={0: 0}, index_dim=dim, kpool=kpool, kda_layers=(), conv_dim=0,
                     conv_width=0, state_shape=(0, 0, 0))


def run_indexer_schedule(data, schedule, *, kpool, topk, tail, page_size=8):
    """Drive write_index_keys + select_positions like an engine. ``data[s]`` = (q, w, k, g) of
    sequence s; ``schedule`` = list of {seq: new tokens}. Returns {seq: rows}, cache."""
    d = data[0][2].shape[-1]
    spec = index_only_spec(kpool, d, page_size)
    pages_per_seq = 8
    cache = allocate_pools(spec, 1 + pages_per_seq * len(data), len(data) + 1, torch.float32)
    order = torch.randperm(pages_per_seq * len(data), generator=gen(9)) + 1
    tables = [order[i * pages_per_seq:(i + 1) * pages_per_seq].tolist() for i in range(len(data))]
    ape = data[0][4] if kpool > 1 else None
    done = [0] * len(data)
    rows = {s: [None] * data[s][0].shape[0] for s in range(len(data))}
    for step in schedule:
        seqs = list(step)
        new = [list(range(step[s])) for s in seqs]
        b = ForwardBatch.build(new, [done[s] for s in seqs], [tables[s] for s in seqs],
                               [s + 1 if kpool > 1 else 0 for s in seqs], cache)
        take = lambda i: torch.cat([data[s][i][done[s]:done[s] + step[s]] for s in seqs])  # noqa: E731
        q, w, k, g = take(0), take(1), take(2), take(3)
        q_lens = b.cu_q[1:] - b.cu_q[:-1]
        write_index_keys(cache.index_keys[0], k, slot_mapping=b.slot_mapping, page_size=page_size,
                         kpool=kpool, gates=g, ape=ape,
                         tail=None if cache.index_tail is None else cache.index_tail[0],
                         positions=b.positions, seq_of_token=b.seq_of_token,
                         start_of_seq=b.ctx_lens_t - q_lens, ctx_of_seq=b.ctx_lens_t,
                         block_tables=b.block_tables, state_slots=b.state_slots)
        sel = select_positions(q, w, cache.index_keys[0], positions=b.positions, q_lens=b.q_lens,
                               ctx_lens=b.ctx_lens, block_tables=b.block_tables, page_size=page_size,
                               topk=topk, kpool=kpool, always_select_tail=tail)
        at = 0
        for s in seqs:
            for j in range(step[s]):
                rows[s][done[s] + j] = sel[at + j].tolist()
            at += step[s]
            done[s] += step[s]
    return rows, cache, tables


def random_indexer_data(t_len, seed, *, heads=2, dim=8, kpool=4, zero_queries=()):
    q = randn(t_len, heads, dim, seed=seed)
    q[list(zero_queries)] = 0.0                     # all-zero scores: ties must go to lower pools
    w = randn(t_len, heads, seed=seed + 1)
    k = randn(t_len, dim, seed=seed + 2)
    g = randn(t_len, dim, seed=seed + 3)
    ape = randn(kpool, dim, seed=99)
    return q, w, k, g, ape


# sequence 0: 37 tokens, sequence 1: 29 tokens; chunks straddle pools and pages, decode steps
# run batched across both sequences with different context lengths
SCHEDULE = ([{0: 5}, {0: 7, 1: 3}, {0: 1, 1: 1}, {1: 10}, {0: 10, 1: 1}]
            + [{0: 1, 1: 1}] * 11 + [{0: 1}] * 3 + [{1: 3}])


@pytest.mark.parametrize("kpool,topk,tail", [(4, 8, True), (4, 12, False), (1, 8, False), (2, 6, True)])
def test_indexer_matches_spec_transcription(kpool, topk, tail):
    data = [random_indexer_data(37, 10, kpool=kpool, zero_queries=(20, 30)),
            random_indexer_data(29, 20, kpool=kpool, zero_queries=(25,))]
    rows, cache, tables = run_indexer_schedule(data, SCHEDULE, kpool=kpool, topk=topk, tail=tail)
    for s, (q, w, k, g, ape) in enumerate(data):
        want, kbar = spec_selection(q, w, k, g, ape, topk=topk, kpool=kpool, tail=tail)
        assert rows[s] == want, f"sequence {s}"
        # every complete pool's key was written once, at its pooled entry
        n_pools = q.shape[0] // kpool
        ent = pooled_rows(torch.tensor([tables[s]]), torch.tensor([0]), torch.arange(n_pools)[None], 8, kpool)
        assert torch.allclose(cache.index_keys[0][ent[0]], kbar, atol=1e-6)
        if kpool > 1:                              # the ring holds the in-progress pool's [k | g]
            r = q.shape[0] % kpool
            tail_rows = cache.index_tail[0, s + 1, :r]
            assert torch.equal(tail_rows, torch.cat([k, g], -1)[q.shape[0] - r:])


def test_indexer_is_dense_when_context_fits_topk():
    data = [random_indexer_data(23, 5)]
    rows, _, _ = run_indexer_schedule(data, [{0: 9}, {0: 1}, {0: 13}], kpool=4, topk=24, tail=True)
    for t, row in enumerate(rows[0]):
        assert sorted(p for p in row if p >= 0) == list(range(t + 1))


def test_pool_keys_is_a_per_channel_softmax_average():
    k, g, ape = randn(3, 4, 5, seed=1), randn(3, 4, 5, seed=2), randn(4, 5, seed=3)
    ref = (torch.softmax(g + ape, dim=1) * k).sum(1)
    assert torch.allclose(pool_keys(k, g, ape), ref, atol=1e-6)


def test_select_positions_rejects_topk_not_multiple_of_kpool():
    with pytest.raises(ValueError, match="index_topk"):
        select_positions(torch.zeros(1, 1, 4), torch.zeros(1, 1), torch.zeros(4, 4),
                         positions=torch.tensor([0]), q_lens=[1], ctx_lens=[1],
                         block_tables=torch.tensor([[1]]), page_size=4, topk=6, kpool=4)


def test_indexer_prefill_score_blocking_gives_same_result(monkeypatch):
    data = [random_indexer_data(37, 10)]
    full, _, _ = run_indexer_schedule(data, [{0: 37}], kpool=4, topk=8, tail=True)
    monkeypatch.setattr(indexer_kernel, "_SCORE_BLOCK", 30)
    blocked, _, _ = run_indexer_schedule(data, [{0: 37}], kpool=4, topk=8, tail=True)
    assert full == blocked


def test_indexer_decode_blocking_gives_same_result(monkeypatch):
    data = [random_indexer_data(37, 10), random_indexer_data(29, 20)]
    full, _, _ = run_indexer_schedule(data, SCHEDULE, kpool=4, topk=8, tail=True)
    monkeypatch.setattr(indexer_kernel, "_SCORE_BLOCK", 1)     # one decode sequence per group
    blocked, _, _ = run_indexer_schedule(data, SCHEDULE, kpool=4, topk=8, tail=True)
    assert full == blocked


# ---- indexer modules vs transformers -------------------------------------------------------

def _drive_module(module_fn, cfg, t_len, chunks, page_size=8):
    """Run ``module_fn(batch, token_slice)`` over ``chunks`` (then single-token decode steps)
    of one sequence through a real cache; returns the per-query outputs concatenated."""
    spec = cache_spec(cfg, page_size)
    cache = allocate_pools(spec, 1 + -(-t_len // page_size) + 2, 2, torch.float32)
    table = list(range(cache.num_pages - 1, 0, -1))
    outs, done = [], 0
    steps = list(chunks) + [1] * (t_len - sum(chunks))
    for n in steps:
        b = ForwardBatch.build([list(range(n))], [done], [table], [1 if spec.needs_state_slot else 0], cache)
        outs.append(module_fn(b, slice(done, done + n)))
        done += n
    return outs


def _as_sets(rows):
    return [sorted(int(p) for p in row if p >= 0) for row in rows]


@pytest.mark.parametrize("layer", [1, 5])
def test_pooled_indexer_matches_hf_glm5_next_indexer(layer):
    from transformers import Glm5NextTextConfig
    from transformers.models.glm5_next.modeling_glm5_next import Glm5NextTextIndexer

    hf_cfg = Glm5NextTextConfig(**GLM5_NEXT_TINY_TEXT)
    cfg = parse_config(hf_cfg.to_dict())
    torch.manual_seed(layer)
    ref = Glm5NextTextIndexer(hf_cfg, layer).eval()
    with torch.no_grad():
        for p in ref.parameters():
            p.copy_(torch.randn_like(p) * 0.3)
    make_indexers_tie_free(ref)
    ours = Indexer(cfg, layer)
    ours.load_state_dict(ref.state_dict(), strict=True)
    t_len = 41
    x, cq = randn(1, t_len, cfg.hidden_size, seed=4), randn(1, t_len, cfg.q_lora_rank, seed=5)
    want = ref(x, cq, torch.ones(1, t_len, dtype=torch.bool), None)[0]
    got = _drive_module(lambda b, sl: ours(x[0, sl], cq[0, sl], b), cfg, t_len, [6, 11])
    got = torch.cat(got)
    assert got.shape == (t_len, cfg.index_topk + cfg.index_kpool - 1)
    assert _as_sets(got) == _as_sets(want)
    assert any(len(r) < t + 1 for t, r in enumerate(_as_sets(got)))   # genuinely sparse


def test_per_token_indexer_matches_hf_glm_moe_dsa_indexer():
    from transformers.models.glm_moe_dsa.modeling_glm_moe_dsa import GlmMoeDsaIndexer, GlmMoeDsaRotaryEmbedding

    hf_cfg = glm_moe_dsa_hf_config()
    cfg = parse_config(hf_cfg.to_dict())
    torch.manual_seed(0)
    ref = GlmMoeDsaIndexer(hf_cfg, 0).eval()
    with torch.no_grad():
        for p in ref.parameters():
            p.copy_(torch.randn_like(p) * 0.3)
    make_indexers_tie_free(ref)
    ours = Indexer(cfg, 0)
    ours.load_state_dict(ref.state_dict(), strict=True)
    t_len = 40
    x, cq = randn(1, t_len, cfg.hidden_size, seed=6), randn(1, t_len, cfg.q_lora_rank, seed=7)
    pos = torch.arange(t_len)[None]
    cos_sin = GlmMoeDsaRotaryEmbedding(hf_cfg)(x, pos)
    mask = torch.full((t_len, t_len), torch.finfo(torch.float32).min).triu(1)[None]
    want = ref(x, cq, cos_sin, mask, pos)[0]
    want = [[p for p in row.tolist() if p <= t] for t, row in enumerate(want)]
    rope = RopeCache(cfg.qk_rope_head_dim, cfg.rope_theta)
    got = _drive_module(lambda b, sl: ours(x[0, sl], cq[0, sl], b, rope.cos_sin(b.positions)),
                        cfg, t_len, [3, 17])
    assert _as_sets(torch.cat(got)) == _as_sets(want)


# ---- sparse MLA ----------------------------------------------------------------------------

def test_sparse_mla_equals_per_query_unabsorbed_attention(monkeypatch):
    heads, c, r, nope, v, page = 3, 6, 4, 5, 7, 4
    t_len = 19
    tables = torch.tensor([[4, 2, 7, 1, 6], [3, 5, 8, 9, 0]])
    latent = randn(40, c + r, seed=1)
    w_kv = randn(heads, nope + v, c, seed=2)
    n = 6
    seq = torch.tensor([0, 0, 1, 1, 1, 0])
    sel = torch.randint(0, t_len, (n, 5), generator=gen(3))
    sel[1, 2:] = -1
    sel[4] = -1                                       # nothing selected -> zeros
    q_nope, q_rope = randn(n, heads, nope, seed=4), randn(n, heads, r, seed=5)
    scale = 0.3
    q_lat = torch.einsum("nhd,hdc->nhc", q_nope, w_kv[:, :nope])
    out = sparse_mla_attention(q_lat, q_rope, latent, sel, block_tables=tables, seq_of_token=seq,
                               page_size=page, scale=scale)
    for i in range(n):
        picks = [int(p) for p in sel[i] if p >= 0]
        rows = [int(tables[seq[i], p // page]) * page + p % page for p in picks]
        for h in range(heads):
            if not picks:
                assert torch.equal(out[i, h], torch.zeros(c))
                continue
            ckv, kr = latent[rows, :c], latent[rows, c:]
            keys = torch.cat([ckv @ w_kv[h, :nope].T, kr], dim=-1)
            vals = ckv @ w_kv[h, nope:].T
            p = torch.softmax(keys @ torch.cat([q_nope[i, h], q_rope[i, h]]) * scale, dim=0)
            assert torch.allclose(w_kv[h, nope:] @ out[i, h], p @ vals, atol=1e-5)
    monkeypatch.setattr(sparse_mla_kernel, "_GATHER_BLOCK", 1)
    blocked = sparse_mla_attention(q_lat, q_rope, latent, sel, block_tables=tables, seq_of_token=seq,
                                   page_size=page, scale=scale)
    assert torch.allclose(out, blocked, atol=1e-6)


def test_sparse_mla_rejects_width_mismatch():
    with pytest.raises(ValueError, match="latent row width"):
        sparse_mla_attention(torch.zeros(1, 1, 4), None, torch.zeros(8, 6), torch.zeros(1, 1, dtype=torch.long),
                             block_tables=torch.tensor([[1]]), seq_of_token=torch.tensor([0]),
                             page_size=4, scale=1.0)


# ---- DSA layer -----------------------------------------------------------------------------

def _glm5_next_text():
    from transformers import Glm5NextTextConfig
    return Glm5NextTextConfig(**GLM5_NEXT_TINY_TEXT)


def _randomise(module, seed, std=0.2):
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            if p.dim() == 1 and name.endswith("weight"):
                p.copy_(1.0 + torch.randn_like(p) * 0.1)
            else:
                p.copy_(torch.randn_like(p) * std)
    make_indexers_tie_free(module)


def test_nope_dsa_layers_match_hf_glm5_next_attention():
    """Full layer 1 then shared layer 2 (kpool = 4, tail rule) through chunks and decode steps."""
    from transformers.models.glm5_next.modeling_glm5_next import Glm5NextTextAttention

    hf_cfg = _glm5_next_text()
    hf_cfg._attn_implementation = "eager"
    cfg = parse_config(hf_cfg.to_dict())
    refs = [Glm5NextTextAttention(hf_cfg, i).eval() for i in (1, 2)]
    ours = [DSAAttention(cfg, i) for i in (1, 2)]
    for i, (ref, mine) in enumerate(zip(refs, ours)):
        _randomise(ref, i)
        mine.load_state_dict(ref.state_dict(), strict=True)
    assert ours[1].indexer is None and ours[0].indexer is not None
    t_len = 37
    x1, x2 = randn(1, t_len, cfg.hidden_size, seed=8), randn(1, t_len, cfg.hidden_size, seed=9)
    mask = torch.ones(1, t_len, dtype=torch.bool)
    with torch.no_grad():
        want1, _, topk = refs[0](x1, mask)
        want2, _, _ = refs[1](x2, mask, prev_topk_indices=topk)

    def step(b, sl):
        o1, sel = ours[0](x1[0, sl], b)
        o2, sel2 = ours[1](x2[0, sl], b, sel)
        assert sel2 is sel
        return o1, o2, sel

    with torch.no_grad():
        outs = _drive_module(step, cfg, t_len, [7, 13])
    got1, got2, sel = (torch.cat(t) for t in zip(*outs))
    assert _as_sets(sel) == _as_sets(topk[0])
    assert torch.allclose(got1, want1[0], atol=1e-5)
    assert torch.allclose(got2, want2[0], atol=1e-5)
    with pytest.raises(ValueError, match="shared_selection"):
        _drive_module(lambda b, sl: ours[1](x2[0, sl], b), cfg, 4, [4])


def test_dsa_layer_is_dense_causal_attention_when_context_fits_topk():
    hf_cfg = _glm5_next_text()
    cfg = dataclasses.replace(parse_config(hf_cfg.to_dict()), index_topk=64)
    layer = DSAAttention(cfg, 1)
    _randomise(layer, 3)
    t_len = 30
    x = randn(t_len, cfg.hidden_size, seed=10)
    with torch.no_grad():
        got = torch.cat([o for o, _ in _drive_module(lambda b, sl: layer(x[sl], b), cfg, t_len, [5, 9])])
        cq = layer.q_a_layernorm(layer.q_a_proj(x))
        q = layer.q_b_proj(cq).view(t_len, cfg.num_heads, -1)
        kv = layer.kv_b_proj(layer.kv_a_layernorm(layer.kv_a_proj_with_mqa(x))).view(t_len, cfg.num_heads, -1)
        k, v = kv.split([cfg.qk_nope_head_dim, cfg.v_head_dim], -1)
        s = torch.einsum("shd,thd->hst", q, k) * cfg.qk_nope_head_dim ** -0.5
        s = s.masked_fill(~torch.ones(t_len, t_len, dtype=torch.bool).tril(), float("-inf"))
        o = torch.einsum("hst,thd->shd", torch.softmax(s, -1), v).reshape(t_len, -1)
        want = layer.o_proj(o)
    assert torch.allclose(got, want, atol=1e-5)


# ---- MoE / MLP / norms ---------------------------------------------------------------------

def test_router_matches_hf_with_group_limit():
    from transformers.models.glm_moe_dsa.modeling_glm_moe_dsa import GlmMoeDsaTopkRouter

    hf_cfg = glm_moe_dsa_hf_config(n_routed_experts=16, num_experts_per_tok=4, n_group=4, topk_group=2)
    ref = GlmMoeDsaTopkRouter(hf_cfg)
    with torch.no_grad():
        ref.weight.copy_(randn(16, 128, seed=1, std=0.3))
        ref.e_score_correction_bias.copy_(randn(16, seed=2, std=0.2))
    x = randn(50, 128, seed=3)
    _, w_ref, ids_ref = ref(x)
    w, ids = route(x, ref.weight, ref.e_score_correction_bias, top_k=4, n_group=4, topk_group=2,
                   norm_topk_prob=True, scaling=2.5)
    o_ref, o = ids_ref.sort(-1), ids.sort(-1)
    assert torch.equal(o.values, o_ref.values)
    assert torch.allclose(w.gather(1, o.indices), w_ref.gather(1, o_ref.indices), atol=1e-6)
    # the group limit matters here: chosen experts span at most topk_group groups
    assert ((ids // 4).unsqueeze(-1) == torch.arange(4)).any(1).sum(-1).max() <= 2
    with pytest.raises(ValueError, match="n_group"):
        route(x, ref.weight, None, top_k=2, n_group=3)


def test_grouped_experts_equal_a_per_token_loop():
    n, h, i, e, k = 23, 12, 10, 6, 3
    x = randn(n, h, seed=1)
    gate_up, down = randn(e, 2 * i, h, seed=2, std=0.5), randn(e, h, i, seed=3, std=0.5)
    ids = torch.stack([torch.randperm(e - 1, generator=gen(s))[:k] for s in range(n)])  # expert e-1 idle
    w = torch.rand(n, k, generator=gen(4))
    for limit in (None, 0.7):
        out = grouped_experts(x, w, ids, gate_up, down, limit)
        ref = torch.zeros(n, h)
        for t in range(n):
            for j in range(k):
                gu = gate_up[ids[t, j]] @ x[t]
                ref[t] += w[t, j] * (down[ids[t, j]] @ swiglu(gu[:i], gu[i:], limit))
        assert torch.allclose(out, ref, atol=1e-5)


def test_swiglu_clamps_gate_from_above_and_up_both_ways():
    gate, up = torch.tensor([-20.0, 0.5, 20.0]), torch.tensor([-20.0, 0.5, 20.0])
    out = swiglu(gate, up, 10.0)
    ref = torch.nn.functional.silu(torch.tensor([-20.0, 0.5, 10.0])) * torch.tensor([-10.0, 0.5, 10.0])
    assert torch.equal(out, ref)


@pytest.mark.parametrize("variant", ["glm_moe_dsa", "glm5_next"])
def test_moe_and_mlp_match_hf(variant):
    if variant == "glm_moe_dsa":
        from transformers.models.glm_moe_dsa.modeling_glm_moe_dsa import GlmMoeDsaMLP as RefMLP
        from transformers.models.glm_moe_dsa.modeling_glm_moe_dsa import GlmMoeDsaMoE as RefMoE
        hf_cfg = glm_moe_dsa_hf_config()
    else:
        from transformers.models.glm5_next.modeling_glm5_next import Glm5NextTextMLP as RefMLP
        from transformers.models.glm5_next.modeling_glm5_next import Glm5NextTextMoE as RefMoE
        hf_cfg = _glm5_next_text()
    cfg = parse_config(hf_cfg.to_dict())
    ref_moe, ref_mlp = RefMoE(hf_cfg), RefMLP(hf_cfg)
    for m in (ref_moe, ref_mlp):
        _randomise(m, 1, std=0.3)
    with torch.no_grad():
        ref_moe.gate.e_score_correction_bias.copy_(randn(cfg.n_routed_experts, seed=5, std=0.1))
    moe, mlp = MoE(cfg), MLP(cfg.hidden_size, cfg.intermediate_size, cfg.swiglu_limit)
    moe.load_state_dict(ref_moe.state_dict(), strict=True)
    mlp.load_state_dict(ref_mlp.state_dict(), strict=True)
    x = randn(40, cfg.hidden_size, seed=6, std=3.0)  # large enough that the clamp engages
    with torch.no_grad():
        assert torch.allclose(moe(x), ref_moe(x), atol=1e-4)
        assert torch.allclose(mlp(x), ref_mlp(x), atol=1e-4)
        if variant == "glm5_next":
            pre = ref_mlp.gate_proj(x)
            assert pre.max() > 10.0                     # the clamp was exercised


def test_rmsnorm_casts_before_weighting_like_hf():
    from transformers.models.glm_moe_dsa.modeling_glm_moe_dsa import GlmMoeDsaRMSNorm

    ref, ours = GlmMoeDsaRMSNorm(64, 1e-5), RMSNorm(64, 1e-5)
    with torch.no_grad():
        ref.weight.copy_(randn(64, seed=1))
    ours.load_state_dict(ref.state_dict())
    ref, ours = ref.to(torch.bfloat16), ours.to(torch.bfloat16)
    x = randn(7, 64, seed=2).to(torch.bfloat16)
    assert torch.equal(ours(x), ref(x))


def test_fp32_tensors_survive_a_bf16_cast():
    hf_cfg = _glm5_next_text()
    cfg = parse_config(hf_cfg.to_dict())
    moe, layer = MoE(cfg), DSAAttention(cfg, 1)
    with torch.no_grad():
        moe.gate.e_score_correction_bias.copy_(randn(cfg.n_routed_experts, seed=1) * 1e-3 + 0.1)
        layer.indexer.weights_proj.weight.copy_(randn(*layer.indexer.weights_proj.weight.shape, seed=2))
    bias = moe.gate.e_score_correction_bias.clone()
    wp = layer.indexer.weights_proj.weight.detach().clone()
    moe, layer = moe.to(torch.bfloat16), layer.to(torch.bfloat16)
    assert moe.gate.e_score_correction_bias.dtype == torch.float32
    assert torch.equal(moe.gate.e_score_correction_bias, bias)
    assert torch.equal(layer.indexer.weights_proj.weight, wp)
    assert layer.indexer.index_kpool_compress_ape.dtype == torch.float32
    assert layer.q_a_proj.weight.dtype == torch.bfloat16
