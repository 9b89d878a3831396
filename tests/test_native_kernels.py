"""flashlane's native CPU kernels: the few-row linear (``row_gemm.cpp``) against a float64
reference, batch-invariant, torch's linear beyond its rows; RMSNorm and RoPE (``norm_rope.cpp``)
against their torch formulas; the mHC weights (``mhc_weights.cpp``) against theirs; the KDA
recurrence (``kda_recurrent.cpp``) and the short convolution (``short_conv.cpp``) against the
torch ones; bf16 SwiGLU (``swiglu.cpp``) and greedy argmax (``argmax.cpp``) against torch's; and the
build's failure reasons. (Decode attention:
test_paged_attention.py.)"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from flashlane.kernels import kda, moe, norm, rope, short_conv
from flashlane.kernels.mhc import hc_post, hc_pre, hc_weights
from flashlane.kernels.native import argmax, build, kda_recurrent, mhc_weights, norm_rope, row_gemm, swiglu
from flashlane.kernels.native import short_conv as short_conv_native

def _needs(kernel):
    """Skip where ``kernel`` cannot run on this machine (the reason: its ``unavailable()``)."""
    why = kernel.unavailable()
    return pytest.mark.skipif(why is not None, reason=f"native kernel unavailable: {why}")


needs_native = _needs(row_gemm)


def _reference(x, w, b):
    return F.linear(x.double(), w.double(), None if b is None else b.double()).float()


@needs_native
@pytest.mark.parametrize("n, k", [(576, 576), (49, 77), (7, 13), (1000, 8), (3, 1)])
@pytest.mark.parametrize("bias", [False, True])
def test_matches_a_float64_reference_for_every_row_count_it_takes(n, k, bias):
    g = torch.Generator().manual_seed(n * 31 + k)
    w = torch.randn(n, k, generator=g)
    b = torch.randn(n, generator=g) if bias else None
    for rows in range(1, row_gemm.MAX_ROWS + 1):
        x = torch.randn(rows, k, generator=g)
        want = _reference(x, w, b)
        err = (row_gemm.linear(x, w, b) - want).abs().max().item()
        torch_err = (F.linear(x, w, b) - want).abs().max().item()     # fp32 rounding of a K-long sum
        assert err <= 4 * torch_err + 1e-6, (rows, err, torch_err)


@needs_native
def test_a_row_gets_the_same_bits_alone_and_in_any_batch():
    g = torch.Generator().manual_seed(1)
    w, b = torch.randn(203, 333, generator=g), torch.randn(203, generator=g)
    x = torch.randn(row_gemm.MAX_ROWS, 333, generator=g)
    alone = [row_gemm.linear(x[i:i + 1], w, b) for i in range(len(x))]
    for rows in range(1, row_gemm.MAX_ROWS + 1):
        batch = row_gemm.linear(x[:rows], w, b)
        for i in range(rows):
            assert torch.equal(batch[i:i + 1], alone[i]), (rows, i)


@pytest.mark.skipif(row_gemm.unavailable("avx512") is not None, reason="the AVX-512 build needs a CPU with avx512f")
@pytest.mark.parametrize("n, k", [(576, 576), (49, 77), (7, 13), (1000, 8), (3, 1), (6, 1536)])
def test_the_avx512_build_sums_as_the_avx2_build_bit_for_bit(monkeypatch, n, k):
    """Two weight rows per 16-lane vector, each half summed as the AVX2 build's 8 lanes, up to 8
    rows of x per pass: the same bits for float32, int8 weight-only and W8A8 weights at every row
    count it takes, on ragged N and K; the AVX-512 build is the one this CPU gets."""
    g = torch.Generator().manual_seed(n + k)
    w, b = torch.randn(n, k, generator=g), torch.randn(n, generator=g)
    qw = torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=g)
    scale = torch.rand(n, generator=g)
    assert row_gemm.best_variant() == "avx512"
    for rows in range(1, row_gemm.MAX_ROWS + 1):
        x = torch.randn(rows, k, generator=g)
        got = {}
        for variant in ("avx2", "avx512"):
            monkeypatch.setattr(row_gemm, "best_variant", lambda v=variant: v)
            got[variant] = (row_gemm.linear(x, w, b if rows % 2 else None),
                            row_gemm.int8_linear(x, qw, scale, b, None),
                            row_gemm.int8_linear(x, qw, scale, None, None, activations="int8"))
        for wide, narrow in zip(got["avx512"], got["avx2"]):
            assert torch.equal(wide, narrow), (rows, n, k)


@needs_native
def test_shapes_strides_and_what_it_hands_to_torch():
    g = torch.Generator().manual_seed(2)
    w = torch.randn(40, 24, generator=g)
    x3 = torch.randn(2, 3, 24, generator=g)                        # leading dims kept
    torch.testing.assert_close(row_gemm.linear(x3, w, None), _reference(x3, w, None), rtol=1e-5, atol=1e-5)
    wide = torch.randn(4, 48, generator=g)[:, ::2]                 # rows not contiguous: copied first
    torch.testing.assert_close(row_gemm.linear(wide, w, None), _reference(wide, w, None), rtol=1e-5, atol=1e-5)
    many = torch.randn(row_gemm.MAX_ROWS + 1, 24, generator=g)     # more rows, other dtypes: torch's own
    assert torch.equal(row_gemm.linear(many, w, None), F.linear(many, w))
    xh, wh = many[:2].half(), w.half()
    assert torch.equal(row_gemm.linear(xh, wh, None), F.linear(xh, wh))
    xb, wb = many[:row_gemm.max_rows(torch.bfloat16) + 1].bfloat16(), w.bfloat16()   # bf16: past its rows
    assert torch.equal(row_gemm.linear(xb, wb, None), F.linear(xb, wb))
    assert row_gemm.linear(torch.randn(0, 24), w, None).shape == (0, 40)


needs_amx = pytest.mark.skipif(row_gemm.amx_unavailable() is not None,
                               reason=f"AMX kernel unavailable: {row_gemm.amx_unavailable()}")


@needs_amx
@pytest.mark.parametrize("n, k", [(576, 576), (100, 64), (3, 32), (577, 1536), (4096, 96)])
@pytest.mark.parametrize("threads", [1, 2])
def test_amx_linear_rounds_float32_sums_once_and_a_row_does_not_depend_on_the_others(n, k, threads):
    """bf16 rows against bf16 weights on AMX tiles: within one bf16 rounding of the float32 product
    for every row count it takes (1-16); a row alone equals the same row among 16, with the
    features split over threads or not; 17 rows and a K that is not a multiple of 32 go elsewhere."""
    g = torch.Generator().manual_seed(n + k)
    w, bias = torch.randn(n, k, generator=g).bfloat16(), torch.randn(n, generator=g).bfloat16()
    x = torch.randn(row_gemm.AMX_MAX_ROWS + 1, k, generator=g).bfloat16()
    prev = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        full = row_gemm.linear(x[:16], w, bias)
        want = x[:16].float() @ w.float().T + bias.float()
        torch.testing.assert_close(full.float(), want, rtol=2 ** -8, atol=1e-3 * k ** 0.5)
        for rows in range(1, 17):
            assert torch.equal(row_gemm.linear(x[:rows], w, bias), full[:rows]), rows
        assert torch.equal(row_gemm.linear(x[16:17], w, None), row_gemm.linear(x[:17], w, None)[16:])
        assert torch.equal(row_gemm.linear(x, w, bias), F.linear(x, w, bias))      # 17 rows: torch's
    finally:
        torch.set_num_threads(prev)
    assert row_gemm.max_rows(torch.bfloat16) == row_gemm.AMX_MAX_ROWS


@needs_amx
def test_amx_declines_a_k_that_is_not_a_multiple_of_32():
    g = torch.Generator().manual_seed(5)
    w, x = torch.randn(64, 48, generator=g).bfloat16(), torch.randn(8, 48, generator=g).bfloat16()
    assert torch.equal(row_gemm.linear(x, w, None), F.linear(x, w))    # 8 rows: past the dot kernel's 2


def test_amx_needs_the_tile_flags_by_name():
    from flashlane.kernels.cpu_caps import CpuCaps

    bf16 = CpuCaps("AVX512", frozenset({"avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512_bf16"}))
    assert row_gemm.amx_cpu_unavailable(bf16) == "the CPU lacks amx_tile, amx_bf16"
    assert row_gemm.amx_cpu_unavailable(CpuCaps("AMX", bf16.flags | {"amx_tile", "amx_bf16"})) is None


def test_no_compiler_and_a_failed_build_are_reasons_not_crashes(monkeypatch, tmp_path):
    monkeypatch.setattr(build.shutil, "which", lambda name: None)
    with pytest.raises(build.NativeUnavailable, match="no C\\+\\+ compiler"):
        build.compiler()
    monkeypatch.undo()
    try:
        build.compiler()
    except build.NativeUnavailable:
        pytest.skip("no C++ compiler on this machine")
    (tmp_path / "broken_kernel.cpp").write_text("this is not C++\n")
    monkeypatch.setattr(build, "HERE", tmp_path)
    monkeypatch.setenv("FLASHLANE_CACHE", str(tmp_path / "cache"))
    with pytest.raises(build.NativeUnavailable, match="could not build broken_kernel.cpp"):
        build.load("broken_kernel", ())
    assert not list((tmp_path / "cache" / "kernels").glob("*.so"))       # nothing half-built left


def test_a_cpu_without_avx2_is_refused_by_name():
    from flashlane.kernels.cpu_caps import CpuCaps
    from flashlane.kernels.native import simd_variants

    sse = CpuCaps("DEFAULT", frozenset({"sse4_2"}))     # what row_gemm.unavailable() asks of this CPU's caps
    assert simd_variants.cpu_unavailable("avx2", sse) == "the CPU lacks avx2, fma, f16c"
    assert simd_variants.cpu_unavailable("avx512", sse) == "the CPU lacks avx512f"
    assert row_gemm.cpu_unavailable(CpuCaps("DEFAULT", frozenset({"sse4_2"}))) == "the CPU lacks avx2, fma, f16c"
    assert "capability DEFAULT" in row_gemm.cpu_unavailable(CpuCaps("DEFAULT"))


# ---- RMSNorm and rotate-half RoPE (norm_rope.cpp) ----------------------------------------------

needs_norm_rope = _needs(norm_rope)


@needs_norm_rope
@pytest.mark.parametrize("dim", [576, 64, 13, 1])
def test_rms_norm_matches_the_torch_formula_and_each_row_stands_alone(dim):
    g = torch.Generator().manual_seed(dim)
    x, w = torch.randn(7, dim, generator=g) * 3, torch.randn(dim, generator=g)
    got = norm_rope.rms_norm(x, w, 1e-5)
    torch.testing.assert_close(got, norm.rms_norm(x, w, 1e-5), rtol=2e-6, atol=2e-6)
    for i in range(7):
        assert torch.equal(norm_rope.rms_norm(x[i:i + 1], w, 1e-5), got[i:i + 1])
    strided = torch.randn(7, 2 * dim, generator=g)[:, :dim]                # rows with a stride
    torch.testing.assert_close(norm_rope.rms_norm(strided, w, 1e-5), norm.rms_norm(strided, w, 1e-5),
                               rtol=2e-6, atol=2e-6)
    x3 = x.view(7, 1, dim)
    assert norm_rope.rms_norm(x3, w, 1e-5).shape == x3.shape


@needs_norm_rope
@pytest.mark.parametrize("heads, d", [(9, 64), (2, 16), (3, 6)])
def test_rope_equals_the_torch_formula_bit_for_bit_on_strided_heads(heads, d):
    g = torch.Generator().manual_seed(heads * d)
    qkv = torch.randn(5, heads + 4, d, generator=g)
    x = qkv[:, 2:2 + heads]                                                   # a view into a fused output
    cos, sin = torch.randn(5, d, generator=g), torch.randn(5, d, generator=g)
    # bit-identical: each product and sum rounds where torch's elementwise ops round (built
    # without FMA contraction); a last-bit difference here flipped w8a8 SmolLM2's greedy answer
    assert torch.equal(norm_rope.rope_rotate_half(x, cos, sin), rope.apply_rope_rotate_half(x, cos, sin))


@needs_norm_rope
@pytest.mark.parametrize("dim", [576, 13])
def test_bf16_rms_norm_rounds_where_the_torch_formula_rounds(dim):
    """bf16: normalised in float32 and rounded, then times the weight and rounded, as
    ``norm.rms_norm`` does; the sum of squares runs in another order than torch's mean, which
    may move the normalised value across a bf16 rounding boundary: at most one bf16 step apart."""
    g = torch.Generator().manual_seed(dim)
    x, w = (torch.randn(7, dim, generator=g) * 3).bfloat16(), torch.randn(dim, generator=g).bfloat16()
    got, want = norm_rope.rms_norm(x, w, 1e-5), norm.rms_norm(x, w, 1e-5)
    assert got.dtype == torch.bfloat16
    step = want.float().abs() * 2 ** -7 + 1e-30
    assert ((got.float() - want.float()).abs() <= step).all()
    assert (got == want).float().mean() > 0.99
    assert torch.equal(norm_rope.rms_norm(x[3:4], w, 1e-5), got[3:4])


@needs_norm_rope
@pytest.mark.parametrize("heads, d", [(9, 64), (3, 6)])
def test_bf16_rope_equals_the_torch_formula_bit_for_bit(heads, d):
    g = torch.Generator().manual_seed(heads * d + 1)
    x = torch.randn(5, heads + 4, d, generator=g).bfloat16()[:, 2:2 + heads]
    cos, sin = torch.randn(5, d, generator=g).bfloat16(), torch.randn(5, d, generator=g).bfloat16()
    got = norm_rope.rope_rotate_half(x, cos, sin)
    assert got.dtype == torch.bfloat16 and torch.equal(got, rope.apply_rope_rotate_half(x, cos, sin))


def test_norm_and_rope_decline_what_is_not_their_case():
    x, w = torch.randn(2, 8), torch.randn(8)
    assert norm_rope.rms_norm(x.half(), w.half(), 1e-5) is None
    assert norm_rope.rms_norm(x.bfloat16(), w, 1e-5) is None                    # mixed dtypes
    assert norm_rope.rms_norm(x, torch.randn(4), 1e-5) is None
    assert norm_rope.rms_norm(x.t(), torch.randn(2), 1e-5) is None              # inner stride not 1
    q = torch.randn(2, 3, 8)
    assert norm_rope.rope_rotate_half(q, torch.randn(2, 6), torch.randn(2, 6)) is None
    assert norm_rope.rope_rotate_half(q.double(), torch.randn(2, 8), torch.randn(2, 8)) is None
    assert norm_rope.rope_rotate_half(torch.randn(2, 3, 7), torch.randn(2, 7), torch.randn(2, 7)) is None


# ---- SwiGLU (swiglu.cpp) --------------------------------------------------------------------------

needs_swiglu = _needs(swiglu)
VARIANTS = [pytest.param(v, marks=pytest.mark.skipif(swiglu.unavailable(v) is not None,
                                                     reason=f"swiglu {v} unavailable: {swiglu.unavailable(v)}"))
            for v in ("avx2", "avx512")]


@needs_swiglu
@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("shape", [(7, 1536), (3, 5, 37), (1, 1)])
@pytest.mark.parametrize("limit", [None, 7.0, 0.3])
def test_bf16_swiglu_equals_torch_bit_for_bit(variant, shape, limit):
    """SiLU rounded to bf16, then the product rounded, as torch's bf16 ops do (the clamped variant
    with its clamps rounded too); every lane and the ragged tail alike, in either build."""
    g = torch.Generator().manual_seed(len(shape) * 7 + shape[-1])
    gate, up = (torch.randn(*shape, generator=g) * 6).bfloat16(), (torch.randn(*shape, generator=g) * 3).bfloat16()
    got = swiglu.swiglu(gate, up, limit, variant)
    assert got.dtype == torch.bfloat16 and got.shape == gate.shape
    assert torch.equal(got, moe.swiglu(gate, up, limit))


@needs_swiglu
def test_bf16_swiglu_takes_the_halves_of_a_fused_gate_up_and_splits_rows_over_threads():
    g = torch.Generator().manual_seed(3)
    gate_up = (torch.randn(300, 2 * 1000, generator=g) * 4).bfloat16()
    gate, up = gate_up.chunk(2, dim=-1)                      # row stride 2000, inner stride 1
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        got = swiglu.swiglu(gate, up)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(got, moe.swiglu(gate, up))


def test_swiglu_declines_what_is_not_its_case_and_the_backend_falls_back():
    from flashlane.kernels.backends.cpu.backend import CpuBackend
    from flashlane.kernels.cpu_caps import CpuCaps

    x = torch.randn(4, 8)
    assert swiglu.swiglu(x, x) is None                                        # float32: torch's
    assert swiglu.swiglu(x.bfloat16(), x.half()) is None
    assert swiglu.swiglu(x.bfloat16(), x.bfloat16()[:, :4]) is None
    assert swiglu.swiglu(x.bfloat16().t(), x.bfloat16().t()) is None          # inner stride not 1
    assert swiglu.swiglu(x.bfloat16(), x.bfloat16(), float("nan")) is None
    assert swiglu.swiglu(x.bfloat16().requires_grad_(), x.bfloat16()) is None
    assert torch.equal(CpuBackend().swiglu(x, x, 2.0), moe.swiglu(x, x, 2.0))
    avx2_only = CpuCaps("AVX2", frozenset({"avx2", "fma", "f16c"}))
    assert swiglu.cpu_unavailable("avx512", avx2_only) == "the CPU lacks avx512f"
    assert swiglu.cpu_unavailable("avx2", avx2_only) is None


# ---- greedy argmax (argmax.cpp) ---------------------------------------------------------------------

needs_argmax = _needs(argmax)


@needs_argmax
def test_argmax_picks_what_torch_argmax_picks():
    """The first index of the row's maximum (ties, -0.0 and 0.0 alike), of its first NaN where it has
    one, index 0 for a row of -inf; strided rows and ragged widths."""
    g = torch.Generator().manual_seed(5)
    wide = torch.randn(8, 49152, generator=g)
    ties = torch.randint(0, 3, (40, 37), generator=g).float()
    odd = torch.randn(6, 100, generator=g)
    odd[1, 50] = odd[1, 70] = float("nan")
    odd[2] = -float("inf")
    odd[3, 5] = float("inf")
    odd[4] = -0.0
    odd[4, 9] = 0.0
    odd[5, 97] = 1e30
    strided = torch.randn(5, 300, generator=g)[:, 7:250]
    for x in (wide, ties, odd, strided, torch.randn(1, 1, generator=g), torch.randn(3, 8, generator=g)):
        assert torch.equal(argmax.argmax(x), x.argmax(dim=-1))


def test_argmax_declines_what_is_not_its_case_and_the_backend_falls_back():
    from flashlane.kernels.backends.cpu.backend import CpuBackend

    x = torch.randn(3, 10)
    assert argmax.argmax(x.bfloat16()) is None
    assert argmax.argmax(x[0]) is None                      # 1-D
    assert argmax.argmax(x.t()) is None                     # inner stride not 1
    assert argmax.argmax(torch.randn(2, 0)) is None
    none = argmax.argmax(torch.randn(0, 5))                 # no rows: an empty pick where it runs
    assert none is None if argmax.unavailable() else none.shape == (0,)
    assert torch.equal(CpuBackend().greedy(x), x.argmax(dim=-1))
    assert torch.equal(CpuBackend().greedy(x.bfloat16()), x.bfloat16().argmax(dim=-1))


# ---- mHC weights (mhc_weights.cpp) ----------------------------------------------------------------

needs_mhc = _needs(mhc_weights)


@needs_mhc
@pytest.mark.parametrize("n, iters", [(4, 20), (2, 1), (6, 3)])
def test_mhc_weights_match_the_torch_formulas_and_are_per_token(n, iters):
    g = torch.Generator().manual_seed(n + iters)
    mixed = 3 * torch.randn(300, (2 + n) * n, generator=g)
    base, scale = torch.randn((2 + n) * n, generator=g), torch.rand(3, generator=g) + 0.5
    got = mhc_weights.mhc_weights(mixed, n, base, scale, 1e-6, iters)
    want = hc_weights(mixed, n, base, scale, 1e-6, iters)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
    alone = mhc_weights.mhc_weights(mixed[17:18], n, base, scale, 1e-6, iters)
    assert all(torch.equal(a, b[17:18]) for a, b in zip(alone, got))


@needs_mhc
def test_mhc_weights_decline_what_they_cannot_run():
    mixed, base, scale = torch.randn(3, 24, requires_grad=True), torch.randn(24), torch.ones(3)
    assert mhc_weights.mhc_weights(mixed, 4, base, scale, 1e-6, 20) is None          # autograd would record
    with torch.no_grad():
        assert mhc_weights.mhc_weights(mixed, 4, base, scale, 1e-6, 20) is not None
        assert mhc_weights.mhc_weights(mixed, 3, base, scale, 1e-6, 20) is None      # 24 != (2 + 3) * 3
        assert mhc_weights.mhc_weights(mixed, 4, base, scale, 1e-6, 0) is None


@needs_mhc
@pytest.mark.parametrize("tokens", [1, 5, 300])
def test_hc_post_matches_the_torch_formula(tokens):
    g = torch.Generator().manual_seed(tokens)
    streams, y = torch.randn(tokens, 4, 40, generator=g), torch.randn(tokens, 40, generator=g)
    post, comb = torch.rand(tokens, 4, generator=g), torch.rand(tokens, 4, 4, generator=g)
    torch.testing.assert_close(mhc_weights.mhc_post(y, streams, post, comb), hc_post(y, streams, post, comb),
                               rtol=1e-6, atol=1e-6)
    assert mhc_weights.mhc_post(y.double(), streams.double(), post, comb) is None


def _bf16_ulps(a: torch.Tensor, b: torch.Tensor) -> int:
    """The largest distance between two bf16 tensors in units of the last place (same signs)."""
    ia, ib = a.view(torch.int16).int(), b.view(torch.int16).int()
    return int((ia - ib).abs().max())


@needs_mhc
@pytest.mark.parametrize("tokens, hidden", [(1, 40), (300, 40), (7, 13)])
def test_hc_post_in_bf16_rounds_where_the_torch_formula_rounds(tokens, hidden):
    g = torch.Generator().manual_seed(tokens + hidden)
    streams = torch.randn(tokens, 4, hidden, generator=g).bfloat16()
    y = torch.randn(tokens, hidden, generator=g).bfloat16()
    post, comb = 2 * torch.rand(tokens, 4, generator=g), torch.rand(tokens, 4, 4, generator=g)
    got = mhc_weights.mhc_post(y, streams, post, comb)
    want = hc_post(y, streams, post, comb)
    assert got.dtype == torch.bfloat16 and got.shape == want.shape
    # torch's bf16 matmul may sum the four products in another order: one rounding step apart at most
    assert _bf16_ulps(got, want) <= 1
    p, c = post.bfloat16().float(), comb.bfloat16().float()
    scaled = p.unsqueeze(-1) * y.float().unsqueeze(-2)
    mixed = torch.matmul(c.transpose(-1, -2), streams.float())
    # three roundings to bf16 (each at most half an ulp: 2^-8 relative) from the float32 result
    bound = 2 ** -8 * (scaled.abs() + mixed.abs() + (scaled + mixed).abs()) + 1e-6
    assert ((got.float() - (scaled + mixed)).abs() <= bound).all()
    alone = mhc_weights.mhc_post(y[-1:], streams[-1:], post[-1:], comb[-1:])
    assert torch.equal(alone, got[-1:])
    assert mhc_weights.mhc_post(y.float(), streams, post, comb) is None                 # mixed dtypes


@needs_mhc
@pytest.mark.parametrize("tokens, h", [(9, 32), (1, 13), (300, 40)])
def test_native_hc_pre_matches_torch(tokens, h):
    g = torch.Generator().manual_seed(tokens + h)
    n = 4
    streams = torch.randn(tokens, n, h, generator=g)
    fn, base = 0.05 * torch.randn((2 + n) * n, n * h, generator=g), torch.randn((2 + n) * n, generator=g)
    scale = torch.rand(3, generator=g)
    kw = dict(norm_eps=1e-5, hc_eps=1e-6, sinkhorn_iters=20)
    want = hc_pre(streams, fn, base, scale, **kw)
    got = mhc_weights.hc_pre(streams, fn, base, scale, **kw)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    # (not per token bit for bit: the mixed projection is aten's matmul, whose order depends on rows)
    # bf16 streams: float32 arithmetic throughout, the collapse rounded once to bf16
    half = streams.bfloat16()
    got16, want16 = mhc_weights.hc_pre(half, fn, base, scale, **kw), hc_pre(half, fn, base, scale, **kw)
    assert got16[0].dtype == torch.bfloat16
    assert _bf16_ulps(got16[0], want16[0]) <= 1
    for a, b in zip(got16[1:], want16[1:]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert mhc_weights.hc_pre(streams.double(), fn, base, scale, **kw) is None
    assert mhc_weights.hc_pre(streams, fn[:, 1:], base, scale, **kw) is None               # the torch error


# ---- the KDA recurrence (kda_recurrent.cpp) -------------------------------------------------------

needs_kda = _needs(kda_recurrent)


def _kda_inputs(lens, heads, dk, dv, seed):
    g = torch.Generator().manual_seed(seed)
    n = sum(lens)
    q, k = torch.randn(n, heads, dk, generator=g), torch.randn(n, heads, dk, generator=g)
    v, beta = torch.randn(n, heads, dv, generator=g), torch.rand(n, heads, generator=g)
    gate = -2 * torch.rand(n, heads, dk, generator=g)
    pool = 0.1 * torch.randn(9, heads, dk, dv, generator=g)
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()])
    return q, k, v, gate, beta, pool, cu


@needs_kda
# dv a multiple of 8 up to 64 keeps u and o in registers (one path per width); others the general path
@pytest.mark.parametrize("heads, dk, dv", [(4, 32, 32), (2, 12, 20), (3, 8, 5), (1, 8, 8), (2, 24, 16), (2, 16, 64)])
def test_kda_recurrence_matches_the_torch_recurrence_per_sequence(heads, dk, dv):
    lens = [1, 37, 130, 1, 6]
    q, k, v, gate, beta, pool, cu = _kda_inputs(lens, heads, dk, dv, seed=dk + dv)
    slots, fresh = torch.tensor([3, 1, 5, 2, 7]), torch.tensor([False, True, False, True, False])
    got_pool = pool.clone()
    got = kda_recurrent.kda_varlen(q, k, v, gate, beta, got_pool, cu, slots, fresh)
    for b, (s, e) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
        init = None if fresh[b] else pool[slots[b]][None]
        want, state = kda.kda_recurrent(*(t[None, s:e] for t in (q, k, v, gate, beta)), init)
        torch.testing.assert_close(got[s:e], want[0], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(got_pool[slots[b]], state[0], rtol=1e-5, atol=1e-5)
    untouched = [i for i in range(9) if i not in slots.tolist()]
    assert torch.equal(got_pool[untouched], pool[untouched])


@needs_kda
def test_kda_recurrence_does_not_depend_on_the_batch_or_on_where_the_prefill_was_cut():
    lens = [40, 9, 77]
    q, k, v, gate, beta, pool, cu = _kda_inputs(lens, 4, 16, 16, seed=2)
    slots, fresh = torch.tensor([1, 2, 3]), torch.tensor([True, True, True])
    batched_pool = pool.clone()
    batched = kda_recurrent.kda_varlen(q, k, v, gate, beta, batched_pool, cu, slots, fresh)
    s, e = cu[2].item(), cu[3].item()
    alone_pool = pool.clone()
    parts = []
    for a, z, first in ((s, s + 30, True), (s + 30, e, False)):       # the third prompt in two chunks
        parts.append(kda_recurrent.kda_varlen(q[a:z], k[a:z], v[a:z], gate[a:z], beta[a:z], alone_pool,
                                              torch.tensor([0, z - a]), slots[2:3], torch.tensor([first])))
    assert torch.equal(torch.cat(parts), batched[s:e])
    assert torch.equal(alone_pool[3], batched_pool[3])


@needs_kda
def test_kda_recurrence_declines_what_it_cannot_run():
    q, k, v, gate, beta, pool, cu = _kda_inputs([3], 2, 8, 8, seed=1)
    args = (torch.tensor([1]), torch.tensor([True]))
    assert kda_recurrent.kda_varlen(q, k, v, gate, beta, pool.to(torch.bfloat16), cu, *args) is None
    assert kda_recurrent.kda_varlen(q.requires_grad_(), k, v, gate, beta, pool, cu, *args) is None
    assert kda_recurrent.kda_varlen(q, k, v, gate, beta, pool[:, :1], cu, *args) is None    # 1 head != 2


# ---- the short convolution (short_conv.cpp) ---------------------------------------------------------

needs_conv = _needs(short_conv_native)


@needs_conv
@pytest.mark.parametrize("channels, k", [(384, 4), (13, 3), (8, 2)])
def test_short_conv_matches_the_torch_kernels(channels, k):
    g = torch.Generator().manual_seed(channels + k)
    lens = [1, 5, 2, 40, 1]
    x, w = torch.randn(sum(lens), channels, generator=g), torch.randn(channels, 1, k, generator=g)
    state = torch.randn(9, channels, k - 1, generator=g)
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()])
    slots, fresh = torch.tensor([3, 1, 5, 2, 7]), torch.tensor([False, True, False, True, False])
    got_state, want_state = state.clone(), state.clone()
    got = short_conv_native.short_conv_varlen(x, w, got_state, cu, slots, fresh)
    want = short_conv.short_conv(x, w, want_state, slots, cu, fresh)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    assert torch.equal(got_state, want_state)                  # the newest inputs, copied
    # decode tokens: the torch decode kernel
    dec_state = state.clone()
    step = torch.randn(3, channels, generator=g)
    got_dec = short_conv_native.short_conv_varlen(step, w, got_state, torch.arange(4), slots[:3], fresh[:0].new_zeros(3))
    want_dec = short_conv.short_conv_decode(step, w, want_state, slots[:3])
    torch.testing.assert_close(got_dec, want_dec, rtol=1e-6, atol=1e-6)
    assert torch.equal(got_state, want_state) and not torch.equal(dec_state, got_state)


@needs_conv
def test_short_conv_with_a_bf16_state_matches_the_torch_kernels():
    """A bf16 model keeps its conv states in bf16: the kernel runs on float32 copies of the rows
    it touches and writes them back; no other row changes."""
    g = torch.Generator().manual_seed(11)
    lens = [1, 6, 33]
    x = torch.randn(sum(lens), 24, generator=g).bfloat16()
    w = torch.randn(24, 1, 4, generator=g)
    state = torch.randn(6, 24, 3, generator=g).bfloat16()
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()])
    slots, fresh = torch.tensor([4, 0, 2]), torch.tensor([False, True, False])
    got_state, want_state = state.clone(), state.clone()
    got = short_conv_native.short_conv_varlen(x, w, got_state, cu, slots, fresh)
    want = short_conv.short_conv(x, w, want_state, slots, cu, fresh)
    assert got.dtype == torch.bfloat16
    # both sum in float32 and round once; SiLU's exp differs in the last float32 bits
    torch.testing.assert_close(got.float(), want.float(), rtol=2 ** -7, atol=1e-6)
    assert torch.equal(got_state, want_state)


@needs_conv
def test_short_conv_does_not_depend_on_where_the_prefill_was_cut():
    g = torch.Generator().manual_seed(4)
    x, w = torch.randn(50, 24, generator=g), torch.randn(24, 4, generator=g)
    state = torch.zeros(2, 24, 3)
    whole = short_conv_native.short_conv_varlen(x, w, state.clone(), torch.tensor([0, 50]), torch.tensor([1]),
                                                torch.tensor([True]))
    cut = state.clone()
    parts = [short_conv_native.short_conv_varlen(x[a:z], w, cut, torch.tensor([0, z - a]), torch.tensor([1]),
                                                 torch.tensor([a == 0])) for a, z in ((0, 2), (2, 31), (31, 50))]
    assert torch.equal(torch.cat(parts), whole)


@needs_conv
def test_short_conv_declines_what_it_cannot_run():
    x, w, state = torch.randn(3, 8), torch.randn(8, 4), torch.zeros(2, 8, 3)
    args = (torch.tensor([0, 3]), torch.tensor([1]), torch.tensor([True]))
    assert short_conv_native.short_conv_varlen(x, w, state.to(torch.int32), *args) is None
    assert short_conv_native.short_conv_varlen(x.requires_grad_(), w, state, *args) is None
    assert short_conv_native.short_conv_varlen(x, w[:, :3], state, *args) is None          # K-1 != 3


def test_every_native_kernel_builds_where_the_cpu_and_a_compiler_allow():
    """A kernel that stops compiling must fail here, not turn the backend's native path off and
    leave every test of it skipped."""
    if row_gemm.cpu_unavailable() is not None:
        pytest.skip(f"this CPU runs no native kernel: {row_gemm.cpu_unavailable()}")
    try:
        build.compiler()
    except build.NativeUnavailable as exc:
        pytest.skip(str(exc))
    from flashlane.kernels.backends.cpu.backend import CpuBackend
    from flashlane.kernels.native import block_gemm, decode_layer, paged_attention

    kernels = (row_gemm, norm_rope, paged_attention, decode_layer, block_gemm, mhc_weights, kda_recurrent,
               short_conv_native, swiglu, argmax)
    assert {k.__name__: k.unavailable() for k in kernels} == {k.__name__: None for k in kernels}
    assert CpuBackend().native


@needs_mhc
def test_inside_a_compiled_graph_the_mhc_weights_are_one_opaque_native_op():
    """Traced, the Sinkhorn iterations unroll into a long chain of tiny ops (half a decoder
    layer's graph and of its compile time); the cpu backend hands a graph the native weights as
    one ``flashlane::mhc_weights`` node, with the same numbers as the eager native path."""
    from flashlane.kernels.backends.cpu.backend import CpuBackend

    g = torch.Generator().manual_seed(9)
    n, hidden = 4, 32
    streams = torch.randn(5, n, hidden, generator=g)
    fn, base = torch.randn((2 + n) * n, n * hidden, generator=g), torch.randn((2 + n) * n, generator=g)
    scale, kw = torch.rand(3, generator=g) + 0.5, dict(norm_eps=1e-6, hc_eps=1e-6, sinkhorn_iters=20)
    mixed = 3 * torch.randn(6, (2 + n) * n, generator=g)
    torch.library.opcheck(mhc_weights.weights_op, (mixed, n, base, scale, 1e-6, 20))
    for a, b in zip(mhc_weights.weights_op(mixed, n, base, scale, 1e-6, 20),
                    mhc_weights.mhc_weights(mixed, n, base, scale, 1e-6, 20)):
        assert torch.equal(a, b)
    for a, b in zip(mhc_weights.weights_op(mixed, n, base, scale, 1e-6, 0),      # the kernel declines 0
                    hc_weights(mixed, n, base, scale, 1e-6, 0)):
        assert torch.equal(a, b)

    def traced(native: bool):
        ops, graphs = CpuBackend(), []
        ops.native = native

        def backend(gm, inputs):
            graphs.append([node.target for node in gm.graph.nodes if node.op == "call_function"])
            return gm.forward

        fn_c = torch.compile(lambda s: ops.mhc_pre(s, fn, base, scale, **kw), backend=backend, fullgraph=True)
        with torch.no_grad():
            return fn_c(streams), graphs[0]

    (out, post, comb), nodes = traced(native=True)
    assert nodes.count(torch.ops.flashlane.mhc_weights.default) == 1 and len(nodes) < 30
    want = mhc_weights.hc_pre(streams, fn, base, scale, **kw)
    for a, b in zip((out, post, comb), want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    _, unrolled = traced(native=False)
    assert torch.ops.flashlane.mhc_weights.default not in unrolled and len(unrolled) > 100


@needs_mhc
def test_a_static_graph_engines_eager_steps_take_the_native_mhc_not_a_compiled_torch_one(monkeypatch):
    """With --compile the model asks for its mHC compiled (``compiled=True``); outside a graph the
    cpu backend still runs the native kernels (torch.compile of the torch mHC made a tiny-flash
    prefill 1.3x slower), and only without them falls back to the compiled torch function."""
    from flashlane.kernels.backends.cpu import backend as cpu_backend

    compiled_calls = []

    def fake_compiled(fn):
        compiled_calls.append(fn.__name__)
        return fn

    monkeypatch.setattr(cpu_backend, "compiled_fn", fake_compiled)
    g = torch.Generator().manual_seed(5)
    n, hidden = 4, 32
    streams = torch.randn(7, n, hidden, generator=g)
    fn, base = torch.randn((2 + n) * n, n * hidden, generator=g), torch.randn((2 + n) * n, generator=g)
    scale, kw = torch.rand(3, generator=g) + 0.5, dict(norm_eps=1e-6, hc_eps=1e-6, sinkhorn_iters=20)
    ops = cpu_backend.CpuBackend()
    with torch.no_grad():
        native = ops.mhc_pre(streams, fn, base, scale, **kw)
        asked = ops.mhc_pre(streams, fn, base, scale, **kw, compiled=True)
        y = torch.randn(7, hidden, generator=g)
        post = ops.mhc_post(y, streams, native[1], native[2], compiled=True)
        assert compiled_calls == []
        assert all(torch.equal(a, b) for a, b in zip(native, asked))
        assert torch.equal(post, mhc_weights.mhc_post(y, streams, native[1], native[2]))
        ops.native = False                      # no native kernels: the torch functions, compiled
        fallback = ops.mhc_pre(streams, fn, base, scale, **kw, compiled=True)
        ops.mhc_post(y, streams, fallback[1], fallback[2], compiled=True)
    assert compiled_calls == ["hc_pre", "hc_post"]
    for a, b in zip(fallback, hc_pre(streams, fn, base, scale, **kw)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
