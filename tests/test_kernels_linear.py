"""KDA, short conv, mHC kernels and KDAAttention against the transformers glm5_next reference (fp32)."""

import pytest
import torch
from hf_tiny import glm5_next_hf_config, randomise_glm5_next_constants
from transformers.models.glm5_next import modeling_glm5_next as ref

from flashlane.cache_spec import cache_spec
from flashlane.config import parse_config
from flashlane.engine.cache.pools import allocate_pools
from flashlane.kernels.kda import kda_chunk, kda_decode, kda_gate, kda_recurrent
from flashlane.kernels.mhc import hc_post, hc_pre
from flashlane.kernels.short_conv import short_conv, short_conv_decode
from flashlane.models.forward_batch import ForwardBatch
from flashlane.models.kda_attention import KDAAttention

TOL = 2e-5


def _inputs(b, t, h, d, seed=0, strength=5.0):
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(b, t, h, d, generator=gen) for _ in range(3))
    g = -strength * torch.sigmoid(torch.randn(b, t, h, d, generator=gen))
    beta = torch.rand(b, t, h, generator=gen)
    s0 = torch.randn(b, h, d, d, generator=gen) * 0.5
    return q, k, v, g, beta, s0


# ---- gate ----------------------------------------------------------------------------------

@pytest.mark.parametrize("lower_bound", [-5.0, None])
def test_kda_gate_matches_reference_forget_gate(lower_bound):
    text = glm5_next_hf_config(linear_lower_bound=lower_bound).text_config
    torch.manual_seed(0)
    gate = ref.Glm5NextTextForgetGate(text)
    with torch.no_grad():
        for p in gate.parameters():
            p.normal_(0, 1.0)  # wide z so the softplus branch sees values above 20 too
    x = torch.randn(2, 9, text.hidden_size) * 3
    want = gate(x)
    got = kda_gate(gate.f_b_proj(gate.f_a_proj(x)), gate.dt_bias, gate.A_log, lower_bound)
    assert got.dtype == torch.float32 and got.shape == want.shape
    assert (got <= 0).all()
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)
    if lower_bound is not None:
        assert (got >= lower_bound).all()


def test_kda_gate_rejects_mismatched_shapes():
    with pytest.raises(ValueError, match="dt_bias"):
        kda_gate(torch.zeros(3, 64), torch.zeros(32), torch.zeros(2), -5.0)


# ---- recurrence and chunked form -------------------------------------------------------------

def test_kda_recurrent_matches_reference():
    q, k, v, g, beta, s0 = _inputs(3, 29, 2, 16)
    want_o, want_s = ref.recurrent_kimi_delta_attention(q, k, v, g, beta, s0.clone(), True,
                                                        use_qk_l2norm_in_kernel=True)
    o, s = kda_recurrent(q, k, v, g, beta, s0)
    torch.testing.assert_close(o, want_o, atol=TOL, rtol=0)
    torch.testing.assert_close(s, want_s, atol=TOL, rtol=0)


@pytest.mark.parametrize("length", [1, 7, 63, 64, 65, 150])
def test_kda_chunk_matches_reference_and_recurrent(length):
    q, k, v, g, beta, s0 = _inputs(2, length, 3, 16, seed=length)
    want_o, want_s = ref.chunk_kimi_delta_attention(q, k, v, g, beta, initial_state=s0.clone(),
                                                    output_final_state=True, use_qk_l2norm_in_kernel=True)
    o, s = kda_chunk(q, k, v, g, beta, s0)
    torch.testing.assert_close(o, want_o, atol=TOL, rtol=0)
    torch.testing.assert_close(s, want_s, atol=TOL, rtol=0)
    o_rec, s_rec = kda_recurrent(q, k, v, g, beta, s0)
    torch.testing.assert_close(o, o_rec, atol=TOL, rtol=0)
    torch.testing.assert_close(s, s_rec, atol=TOL, rtol=0)


def test_kda_chunk_zero_initial_state_is_none():
    q, k, v, g, beta, _ = _inputs(1, 70, 2, 8, seed=3)
    o_none, s_none = kda_chunk(q, k, v, g, beta, None)
    o_zero, s_zero = kda_chunk(q, k, v, g, beta, torch.zeros(1, 2, 8, 8))
    torch.testing.assert_close(o_none, o_zero, atol=0, rtol=0)
    torch.testing.assert_close(s_none, s_zero, atol=0, rtol=0)


def test_kda_chunk_state_flows_across_splits():
    q, k, v, g, beta, s0 = _inputs(1, 131, 2, 16, seed=5)
    whole_o, whole_s = kda_chunk(q, k, v, g, beta, s0)
    state, outs = s0, []
    for a, b in ((0, 50), (50, 51), (51, 131)):
        o, state = kda_chunk(q[:, a:b], k[:, a:b], v[:, a:b], g[:, a:b], beta[:, a:b], state)
        outs.append(o)
    torch.testing.assert_close(torch.cat(outs, 1), whole_o, atol=TOL, rtol=0)
    torch.testing.assert_close(state, whole_s, atol=TOL, rtol=0)


def test_kda_chunk_survives_decay_far_beyond_fp32_exp_range():
    # ~-40 per step: a chunk's cumulative decay (~-2500) would overflow exp() if formed naively
    q, k, v, _, beta, s0 = _inputs(1, 96, 2, 8, seed=7)
    g = -40.0 * torch.rand(1, 96, 2, 8, generator=torch.Generator().manual_seed(1)) - 1.0
    o, s = kda_chunk(q, k, v, g, beta, s0)
    o_rec, s_rec = kda_recurrent(q, k, v, g, beta, s0)
    assert torch.isfinite(o).all() and torch.isfinite(s).all()
    torch.testing.assert_close(o, o_rec, atol=TOL, rtol=0)
    torch.testing.assert_close(s, s_rec, atol=TOL, rtol=0)


def test_kda_decode_updates_only_its_slots():
    b, t, h, d = 3, 6, 2, 8
    q, k, v, g, beta, s0 = _inputs(b, t, h, d, seed=11)
    pool = torch.randn(6, h, d, d)
    slots = torch.tensor([4, 1, 3])
    pool[slots] = s0
    untouched = pool[[0, 2, 5]].clone()
    want_o, want_s = kda_recurrent(q, k, v, g, beta, s0)
    for i in range(t):
        o = kda_decode(q[:, i], k[:, i], v[:, i], g[:, i], beta[:, i], pool, slots)
        torch.testing.assert_close(o, want_o[:, i], atol=TOL, rtol=0)
    torch.testing.assert_close(pool[slots], want_s, atol=TOL, rtol=0)
    torch.testing.assert_close(pool[[0, 2, 5]], untouched, atol=0, rtol=0)


def test_kda_decode_fresh_sequences_ignore_stale_slot():
    q, k, v, g, beta, _ = _inputs(2, 1, 2, 8, seed=13)
    pool = torch.randn(3, 2, 8, 8) * 10
    o = kda_decode(q[:, 0], k[:, 0], v[:, 0], g[:, 0], beta[:, 0], pool, torch.tensor([1, 2]),
                   fresh=torch.tensor([True, False]))
    want0, _ = kda_recurrent(q[:1], k[:1], v[:1], g[:1], beta[:1], None)
    torch.testing.assert_close(o[0], want0[0, 0], atol=TOL, rtol=0)


def test_kda_rejects_bad_state_shape():
    q, k, v, g, beta, _ = _inputs(1, 4, 2, 8)
    with pytest.raises(ValueError, match="state"):
        kda_chunk(q, k, v, g, beta, torch.zeros(1, 2, 8, 4))


# ---- short conv ------------------------------------------------------------------------------

def _conv_ref(x_seq, w):
    """transformers' fallback causal conv of one sequence [T, C] -> [T, C]."""
    return ref.causal_conv1d_fn(x_seq.T[None], w, activation="silu")[0].T


def test_short_conv_varlen_matches_reference_and_keeps_last_inputs():
    gen = torch.Generator().manual_seed(0)
    c, kernel = 12, 4
    w = torch.randn(c, kernel, generator=gen)
    lens = [5, 1, 2, 9]
    xs = [torch.randn(n, c, generator=gen) for n in lens]
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()])
    state = torch.randn(6, c, kernel - 1, generator=gen)
    slots = torch.tensor([2, 5, 1, 3])
    out = short_conv(torch.cat(xs), w, state, slots, cu, fresh=torch.ones(4, dtype=torch.bool))
    for b, x in enumerate(xs):
        torch.testing.assert_close(out[cu[b]:cu[b + 1]], _conv_ref(x, w), atol=1e-6, rtol=1e-6)
        padded = torch.cat([torch.zeros(kernel - 1, c), x])
        torch.testing.assert_close(state[slots[b]], padded[-(kernel - 1):].T, atol=0, rtol=0)


def test_short_conv_chunks_and_decode_continue_the_sequence():
    gen = torch.Generator().manual_seed(1)
    c, kernel = 6, 4
    w = torch.randn(c, 1, kernel, generator=gen)
    xa, xb = torch.randn(23, c, generator=gen), torch.randn(19, c, generator=gen)
    want_a, want_b = _conv_ref(xa, w.squeeze(1)), _conv_ref(xb, w.squeeze(1))
    state = torch.zeros(3, c, kernel - 1)
    slots = torch.tensor([2, 1])
    cuts_a, cuts_b = [0, 2, 3, 12, 20], [0, 1, 9, 14, 16]   # pieces shorter and longer than K-1
    got_a, got_b = [], []
    for i in range(len(cuts_a) - 1):
        pa, pb = xa[cuts_a[i]:cuts_a[i + 1]], xb[cuts_b[i]:cuts_b[i + 1]]
        cu = torch.tensor([0, len(pa), len(pa) + len(pb)])
        fresh = torch.tensor([i == 0, i == 0])
        out = short_conv(torch.cat([pa, pb]), w, state, slots, cu, fresh)
        got_a.append(out[:len(pa)])
        got_b.append(out[len(pa):])
    for step in range(3):   # then single-token decode, both sequences at once
        ta, tb = cuts_a[-1] + step, cuts_b[-1] + step
        out = short_conv_decode(torch.stack([xa[ta], xb[tb]]), w, state, slots)
        got_a.append(out[:1])
        got_b.append(out[1:])
    torch.testing.assert_close(torch.cat(got_a), want_a[:23], atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(torch.cat(got_b), want_b[:19], atol=1e-6, rtol=1e-6)


def test_short_conv_rejects_bad_state():
    with pytest.raises(ValueError, match="conv_state"):
        short_conv(torch.zeros(3, 4), torch.zeros(4, 4), torch.zeros(2, 4, 2), torch.tensor([1]),
                   torch.tensor([0, 3]))


# ---- mHC -------------------------------------------------------------------------------------

def test_mhc_pre_and_post_match_reference_hyper_connection():
    text = glm5_next_hf_config(hidden_size=48).text_config
    torch.manual_seed(0)
    hc = ref.Glm5NextTextHyperConnection(text)
    with torch.no_grad():
        hc.fn.normal_(0, 0.5)
        hc.base.normal_(0, 1.0)
        hc.scale.uniform_(0.5, 1.5)
    streams = torch.randn(2, 7, text.hc_mult, text.hidden_size) * 2
    post, comb, collapsed = hc(streams)
    flat = streams.reshape(14, text.hc_mult, text.hidden_size)
    got_u, got_post, got_comb = hc_pre(flat, hc.fn, hc.base, hc.scale, norm_eps=text.rms_norm_eps,
                                       hc_eps=text.hc_eps, sinkhorn_iters=text.hc_sinkhorn_iters)
    torch.testing.assert_close(got_u, collapsed.reshape(14, -1), atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(got_post, post.reshape(14, -1), atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(got_comb, comb.reshape(14, text.hc_mult, text.hc_mult), atol=1e-6, rtol=1e-6)
    # Sinkhorn ends on a column step: columns sum to one
    torch.testing.assert_close(got_comb.sum(-2), torch.ones(14, text.hc_mult), atol=1e-5, rtol=0)
    y = torch.randn(2, 7, text.hidden_size)
    want = post.unsqueeze(-1) * y.unsqueeze(-2) + torch.matmul(comb.transpose(-1, -2), streams)
    torch.testing.assert_close(hc_post(y.reshape(14, -1), flat, got_post, got_comb),
                               want.reshape(14, text.hc_mult, -1), atol=1e-6, rtol=1e-6)


def test_mhc_rejects_wrong_fn_shape():
    with pytest.raises(ValueError, match="fn"):
        hc_pre(torch.zeros(2, 4, 8), torch.zeros(24, 16), torch.zeros(24), torch.ones(3),
               norm_eps=1e-5, hc_eps=1e-6, sinkhorn_iters=3)


# ---- KDAAttention ------------------------------------------------------------------------------

def _kda_pair(seed=0, **overrides):
    hf_cfg = glm5_next_hf_config(**overrides)
    text = hf_cfg.text_config
    torch.manual_seed(seed)
    hf = ref.Glm5NextTextLinearAttention(text, layer_idx=0).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if p.dim() >= 2:
                p.normal_(0, 0.2)
        randomise_glm5_next_constants(hf, seed)
        # the reference makes dt_bias with torch.empty and only a whole model's _init_weights
        # fills it: left alone it is whatever memory the allocator hands back (NaN or inf there
        # gave a NaN in one full run); a seeded spread around FLA's init (softplus^-1 of 1e-3..1e-1)
        dt_bias = hf.forget_gate.dt_bias
        dt_bias.copy_(-4.5 + 1.5 * torch.randn(dt_bias.shape, generator=torch.Generator().manual_seed(seed + 7)))
    cfg = parse_config(hf_cfg.to_dict())
    ours = KDAAttention(cfg, layer_id=0).eval()
    ours.load_state_dict(hf.state_dict(), strict=True)
    return hf, ours, cfg


def _run_paged(ours, cfg, xs, pieces, decode_steps, garbage=False):
    """Feed sequences xs [T_b, H] through the cache like an engine: the last `decode_steps`
    tokens of each are single-token decode steps, the rest is prefilled in pieces of the
    (cycled) `pieces` lengths; every call packs all unfinished sequences, so prefill chunks of
    one sequence share calls with decode steps of another. Returns per-sequence outputs."""
    spec = cache_spec(cfg, page_size=16)
    cache = allocate_pools(spec, 64, len(xs) + 3, torch.float32)
    if garbage:  # stale state from an earlier owner must not leak into a fresh sequence
        cache.conv.normal_()
        cache.recurrent.normal_()
    tables = [list(range(1 + 16 * b, 17 + 16 * b)) for b in range(len(xs))]
    slots = [len(xs) + 1 - b for b in range(len(xs))]
    outs = [[] for _ in xs]
    done = [0] * len(xs)
    prefill_lens = [len(x) - decode_steps for x in xs]
    call = 0
    while any(d < len(x) for d, x in zip(done, xs)):
        news = []
        for b, x in enumerate(xs):
            if done[b] < prefill_lens[b]:
                news.append((b, done[b], min(prefill_lens[b], done[b] + pieces[call % len(pieces)])))
            elif done[b] < len(x):
                news.append((b, done[b], done[b] + 1))
        call += 1
        batch = ForwardBatch.build([[0] * (e - s) for _, s, e in news], [s for _, s, _ in news],
                                   [tables[b] for b, _, _ in news], [slots[b] for b, _, _ in news], cache)
        x = torch.cat([xs[b][s:e] for b, s, e in news])
        with torch.no_grad():
            y = ours(x, batch)
        at = 0
        for b, s, e in news:
            outs[b].append(y[at:at + e - s])
            at += e - s
            done[b] = e
    return [torch.cat(o) for o in outs]


def test_kda_attention_parameter_names_match_reference():
    hf, ours, _ = _kda_pair()
    assert set(ours.state_dict()) == set(hf.state_dict())
    for name, t in hf.state_dict().items():
        assert ours.state_dict()[name].shape == t.shape, name


@pytest.mark.parametrize("pieces,decode_steps,garbage", [
    ([10_000], 0, False),          # whole prompts in one batched call
    ([10_000], 6, True),           # prefill then batched decode, stale slots
    ([13, 64, 1, 40], 5, False),   # chunked prefill: odd and FLA-chunk-sized pieces
])
def test_kda_attention_matches_reference_through_cache(pieces, decode_steps, garbage):
    hf, ours, cfg = _kda_pair(seed=1)
    gen = torch.Generator().manual_seed(2)
    lengths = [70, 21, 130]
    xs = [torch.randn(n, cfg.hidden_size, generator=gen) for n in lengths]
    with torch.no_grad():
        want = [hf(x[None])[0] for x in xs]
    got = _run_paged(ours, cfg, xs, pieces, decode_steps, garbage)
    for g, w in zip(got, want):
        assert g.shape == w.shape
        torch.testing.assert_close(g, w, atol=1e-4, rtol=1e-4)


def test_kda_attention_softplus_gate_variant_matches_reference():
    hf, ours, cfg = _kda_pair(seed=3, linear_lower_bound=None)
    xs = [torch.randn(40, cfg.hidden_size, generator=torch.Generator().manual_seed(4))]
    with torch.no_grad():
        want = hf(xs[0][None])[0]
    got = _run_paged(ours, cfg, xs, [17], decode_steps=4)[0]
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_kda_attention_rejects_config_without_linear_heads():
    cfg = parse_config(glm5_next_hf_config().to_dict())
    from dataclasses import replace
    with pytest.raises(ValueError, match="linear_num_heads"):
        KDAAttention(replace(cfg, linear_num_heads=0), layer_id=0)
