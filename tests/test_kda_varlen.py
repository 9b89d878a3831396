"""kda_chunk_varlen (all sequences of a step at once) against kda_recurrent and kda_chunk per sequence."""

import itertools
import math

import pytest
import torch

from flashlane.kernels import kda
from flashlane.kernels.kda import kda_chunk, kda_chunk_varlen, kda_gate, kda_recurrent

LENGTHS = (1, 3, 63, 64, 65, 200, 513)
H, DK, DV = 2, 16, 8      # Dk != Dv so a swapped state orientation cannot pass


def _packed(lengths, seed=0, lower_bound=-5.0, rate=1.0, dtype=torch.float32):
    """Flat inputs of ``lengths`` sequences with gates from kda_gate (bounded or softplus form)."""
    gen = torch.Generator().manual_seed(seed)
    n = sum(lengths)
    q, k = (torch.randn(n, H, DK, generator=gen) for _ in range(2))
    v = torch.randn(n, H, DV, generator=gen)
    f = torch.randn(n, H * DK, generator=gen) * 3
    g = kda_gate(f, torch.zeros(H * DK), torch.full((H,), math.log(rate)), lower_bound)
    beta = torch.rand(n, H, generator=gen)
    s0 = torch.randn(len(lengths), H, DK, DV, generator=gen) * 0.5
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int64)
    q, k, v, beta = (x.to(dtype) for x in (q, k, v, beta))
    return q, k, v, g, beta, cu, s0


def _per_sequence(fn, q, k, v, g, beta, cu, s0):
    """``fn`` (kda_recurrent or kda_chunk) run on each sequence alone; outputs concatenated."""
    outs, finals = [], []
    bounds = cu.tolist()
    for b, (s, e) in enumerate(itertools.pairwise(bounds)):
        init = None if s0 is None else s0[b : b + 1]
        o, st = fn(q[None, s:e], k[None, s:e], v[None, s:e], g[None, s:e], beta[None, s:e], init)
        outs.append(o[0])
        finals.append(st[0])
    return torch.cat(outs), torch.stack(finals)


def _assert_rel(got, want, rel):
    """Max abs error within ``rel`` of the reference's scale (max |want|, at least 1)."""
    assert got.shape == want.shape and got.dtype == want.dtype
    scale = max(1.0, want.float().abs().max().item())
    err = (got.float() - want.float()).abs().max().item()
    assert err <= rel * scale, f"max abs error {err:.3g} > {rel:g} * {scale:.3g}"


@pytest.mark.parametrize("chunk_size", [64, 32, 128, 48, 100])
@pytest.mark.parametrize("with_state", [True, False])
@pytest.mark.parametrize("lower_bound, rate, rel", [(-5.0, 1.0, 1e-5), (None, 1.0, 1e-5), (None, 30.0, 1e-4)],
                         ids=["lower-bound", "softplus", "softplus-strong"])
def test_varlen_matches_recurrent_per_sequence(chunk_size, with_state, lower_bound, rate, rel):
    q, k, v, g, beta, cu, s0 = _packed(LENGTHS, seed=chunk_size, lower_bound=lower_bound, rate=rate)
    if rate > 1:
        # a chunk's cumulative decay (thousands) is far outside exp()'s fp32 range; at that size
        # fp32 cumulative sums lose digits of G_t - G_s, in kda_chunk exactly as here, hence rel
        assert g.mean() < -20
    s0 = s0 if with_state else None
    o, final = kda_chunk_varlen(q, k, v, g, beta, cu, s0, chunk_size=chunk_size)
    want_o, want_s = _per_sequence(kda_recurrent, q, k, v, g, beta, cu, s0)
    assert torch.isfinite(o).all() and torch.isfinite(final).all()
    _assert_rel(o, want_o, rel)
    _assert_rel(final, want_s, rel)
    chunk_o, chunk_s = _per_sequence(lambda *a: kda_chunk(*a, chunk_size=chunk_size), q, k, v, g, beta, cu, s0)
    _assert_rel(o, chunk_o, 2e-6)
    _assert_rel(final, chunk_s, 2e-6)


def test_varlen_bf16_inputs():
    q, k, v, g, beta, cu, s0 = _packed(LENGTHS, seed=4, dtype=torch.bfloat16)
    o, final = kda_chunk_varlen(q, k, v, g, beta, cu, s0)
    want_o, want_s = _per_sequence(kda_recurrent, q, k, v, g, beta, cu, s0)
    assert o.dtype == torch.bfloat16 and final.dtype == torch.float32
    _assert_rel(o, want_o, 1e-2)      # both round their fp32 result to bf16
    _assert_rel(final, want_s, 1e-5)  # same bf16 inputs, fp32 math on both sides


def test_decode_tokens_among_prefills():
    lengths = (1, 300, 1, 1, 70, 1)
    q, k, v, g, beta, cu, s0 = _packed(lengths, seed=5)
    o, final = kda_chunk_varlen(q, k, v, g, beta, cu, s0)
    want_o, want_s = _per_sequence(kda_recurrent, q, k, v, g, beta, cu, s0)
    _assert_rel(o, want_o, 1e-5)
    _assert_rel(final, want_s, 1e-5)
    decodes = torch.tensor([0, 301, 302, 373])
    pool = s0.clone()
    step = kda.kda_decode(q[decodes], k[decodes], v[decodes], g[decodes], beta[decodes], pool,
                          torch.tensor([0, 2, 3, 5]))
    _assert_rel(o[decodes], step, 1e-6)
    _assert_rel(final[[0, 2, 3, 5]], pool[[0, 2, 3, 5]], 1e-6)


def test_zero_steps_are_no_ops_so_padding_is_exact():
    # the padding of a short last chunk is steps with g = k = q = v = beta = 0; written out as real
    # steps of the sequence they must leave the outputs before them and the final state unchanged
    q, k, v, g, beta, cu, s0 = _packed((65,), seed=6)
    zeros = [torch.zeros(63, *x.shape[1:]) for x in (q, k, v, g, beta)]
    longer = [torch.cat((x, z)) for x, z in zip((q, k, v, g, beta), zeros)]
    o, final = kda_chunk_varlen(q, k, v, g, beta, cu, s0)
    o_pad, final_pad = kda_chunk_varlen(*longer, torch.tensor([0, 128]), s0)
    assert torch.equal(o_pad[65:], torch.zeros_like(o_pad[65:]))
    _assert_rel(o_pad[:65], o, 1e-6)
    _assert_rel(final_pad, final, 1e-6)


def test_padding_equals_explicit_zero_steps_bit_for_bit():
    # 40 steps pad to 48; the same 40 steps followed by 8 explicit zero steps fill those 48 exactly
    q, k, v, g, beta, cu, s0 = _packed((40,), seed=12)
    longer = [torch.cat((x, torch.zeros(8, *x.shape[1:]))) for x in (q, k, v, g, beta)]
    o, final = kda_chunk_varlen(q, k, v, g, beta, cu, s0, chunk_size=64)
    o_pad, final_pad = kda_chunk_varlen(*longer, torch.tensor([0, 48]), s0, chunk_size=64)
    assert torch.equal(o_pad[:40], o) and torch.equal(final_pad, final)


def test_perturbing_one_sequence_leaves_the_others_bit_identical():
    lengths = (70, 5, 130, 1, 64)
    q, k, v, g, beta, cu, s0 = _packed(lengths, seed=7)
    o, final = kda_chunk_varlen(q, k, v, g, beta, cu, s0)
    s, e = cu[2].item(), cu[3].item()
    gen = torch.Generator().manual_seed(8)
    q2, k2, v2, g2, beta2, s02 = (x.clone() for x in (q, k, v, g, beta, s0))
    for x in (q2, k2, v2):
        x[s:e] = torch.randn(e - s, *x.shape[1:], generator=gen)
    g2[s:e] = g2[s:e] * 3
    beta2[s:e] = 1 - beta2[s:e]
    s02[2] = -s02[2]
    o2, final2 = kda_chunk_varlen(q2, k2, v2, g2, beta2, cu, s02)
    others = torch.ones(cu[-1].item(), dtype=torch.bool)
    others[s:e] = False
    assert torch.equal(o2[others], o[others])
    assert torch.equal(final2[[0, 1, 3, 4]], final[[0, 1, 3, 4]])
    assert not torch.allclose(o2[s:e], o[s:e]) and not torch.allclose(final2[2], final[2])


def test_small_memory_bound_splits_blocks_without_changing_results(monkeypatch):
    q, k, v, g, beta, cu, s0 = _packed((200, 130, 64, 3), seed=9)
    o, final = kda_chunk_varlen(q, k, v, g, beta, cu, s0)
    monkeypatch.setattr(kda, "VARLEN_BLOCK_BYTES", 1)     # one chunk per block
    o1, final1 = kda_chunk_varlen(q, k, v, g, beta, cu, s0)
    _assert_rel(o1, o, 1e-6)
    _assert_rel(final1, final, 1e-6)


def test_none_initial_state_is_zeros():
    q, k, v, g, beta, cu, _ = _packed((70, 9), seed=10)
    o, final = kda_chunk_varlen(q, k, v, g, beta, cu, None)
    o0, final0 = kda_chunk_varlen(q, k, v, g, beta, cu, torch.zeros(2, H, DK, DV))
    assert torch.equal(o, o0) and torch.equal(final, final0)


@pytest.mark.parametrize("cu, match", [([1, 5, 10], "rise strictly"), ([0, 5, 9], "rise strictly"),
                                       ([0, 5, 5, 10], "rise strictly"), ([0], "1-D integer")])
def test_rejects_bad_cu_seqlens(cu, match):
    q, k, v, g, beta, _, _ = _packed((5, 5))
    with pytest.raises(ValueError, match=match):
        kda_chunk_varlen(q, k, v, g, beta, torch.tensor(cu), None)


def test_rejects_bad_state_and_layout():
    q, k, v, g, beta, cu, s0 = _packed((5, 5))
    with pytest.raises(ValueError, match="state has shape"):
        kda_chunk_varlen(q, k, v, g, beta, cu, s0[:1])
    with pytest.raises(ValueError, match="flat tokens"):
        kda_chunk_varlen(q[None], k[None], v[None], g[None], beta[None], cu, s0)


@pytest.mark.parametrize("span", [kda.DECAY_SPAN_LIMIT - 0.5, kda.DECAY_SPAN_LIMIT + 0.5])
def test_decay_spans_at_the_factorisation_limit(span):
    # one channel per head decays by `span` across a 64-step chunk, the rest barely: just below the
    # limit the whole chunk is one sub-block (factors up to e^span), just above it is split
    q, k, v, g, beta, cu, s0 = _packed((64, 64), seed=11)
    g = torch.full_like(g, -0.01)
    g[..., 0] = -span / 63
    gc = g.view(2, 64, H, DK).transpose(1, 2).cumsum(2)
    assert kda._sub_blocks(gc).tolist() == ([64, 64] if span < kda.DECAY_SPAN_LIMIT else [32, 32])
    o, final = kda_chunk_varlen(q, k, v, g, beta, cu, s0, chunk_size=64)
    want_o, want_s = _per_sequence(kda_recurrent, q, k, v, g, beta, cu, s0)
    _assert_rel(o, want_o, 1e-5)
    _assert_rel(final, want_s, 1e-5)
