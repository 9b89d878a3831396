"""The native whole-layer llama decode (kernels/native/decode_layer): against the same layer
composed from torch formulas, in the engine against the separate native ops and torch's path,
and what it declines."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from engine_models import bf16_copy, preset, random_prompts, tiny_llama
from test_paged_attention import _reference as gather_and_sdpa
from flashlane.engine.llm import LLM
from flashlane.engine.sampling_params import SamplingParams
from flashlane.kernels import gguf_blocks
from flashlane.kernels.backends.cpu.backend import CpuBackend
from flashlane.kernels.native import decode_layer
from flashlane.kernels.norm import rms_norm
from flashlane.kernels.quant_matmul import int8_linear_reference, quantize_int8, w8a8_linear
from flashlane.kernels.rope import apply_rope_rotate_half

WHY_NOT = decode_layer.unavailable()
pytestmark = pytest.mark.skipif(WHY_NOT is not None, reason=f"native kernel unavailable: {WHY_NOT}")


def _layer(g, hidden, inter, heads, kv, hd, qkv_bias, kind="float32"):
    def w(n, k):
        return torch.randn(n, k, generator=g) / k ** 0.5

    ln1, ln2 = 1 + 0.1 * torch.randn(hidden, generator=g), 1 + 0.1 * torch.randn(hidden, generator=g)
    mats = [w(heads * hd, hidden), w(kv * hd, hidden), w(kv * hd, hidden), w(hidden, heads * hd),
            w(inter, hidden), w(inter, hidden), w(hidden, inter)]
    def lin(i, m):
        bias = 0.1 * torch.randn(m.shape[0], generator=g) if qkv_bias and i < 3 else None
        return (decode_layer.Linear(kind, m, None, bias) if kind == "float32"
                else decode_layer.Linear(kind, *quantize_int8(m), bias))

    linears = [lin(i, m) for i, m in enumerate(mats)]
    return decode_layer.LayerWeights(ln1, ln2, 1e-5, linears, heads, kv, hd)


def _reference(h, w, cos, sin, pool, slots, tables, lens, page):
    """The layer from torch formulas: RMSNorm, linears, RoPE, the pool write, SDPA over the
    gathered history, SiLU * up, residuals."""
    ln1, ln2, lq, lk, lv, lo, lg, lu, ld = w.tensors
    m, heads, kv, hd = h.shape[0], w.heads, w.kv_heads, w.head_dim

    def mm(lin, x):
        if lin.kind == "float32":
            return F.linear(x, lin.weight, lin.bias)
        if lin.kind in gguf_blocks.BYTES:          # repacked GGUF blocks: the torch block product
            blocks = gguf_blocks.unrepack(lin.kind, lin.weight, lin.out_features)
            return gguf_blocks.block_linear(x, lin.kind, blocks, lin.bias)
        kernel = int8_linear_reference if lin.kind == "int8" else w8a8_linear
        return kernel(x, lin.weight, lin.scale, lin.bias)

    x = rms_norm(h, ln1, w.eps)
    q = apply_rope_rotate_half(mm(lq, x).view(m, heads, hd), cos, sin)
    k = apply_rope_rotate_half(mm(lk, x).view(m, kv, hd), cos, sin)
    v = mm(lv, x).view(m, kv, hd)
    pool[slots] = torch.cat((k.reshape(m, -1), v.reshape(m, -1)), -1)
    att = gather_and_sdpa(q, pool, tables, lens, kv, page)
    h1 = h + mm(lo, att.reshape(m, -1))
    x2 = rms_norm(h1, ln2, w.eps)
    return h1 + mm(ld, F.silu(mm(lg, x2)) * mm(lu, x2))


@pytest.mark.parametrize("kind", ["float32", "int8", "w8a8"])
@pytest.mark.parametrize("heads, kv, hd, page, qkv_bias", [(9, 3, 64, 16, False), (4, 4, 16, 1, True),
                                                           (8, 2, 32, 4, False), (6, 1, 8, 16, True)])
def test_matches_the_layer_composed_from_torch_formulas(heads, kv, hd, page, qkv_bias, kind):
    g = torch.Generator().manual_seed(heads * 10 + hd + page)
    hidden, inter = 48, 136           # neither a multiple of 32: every kernel's tail runs
    w = _layer(g, hidden, inter, heads, kv, hd, qkv_bias, kind)
    check_against_composed(w, g, torch.tensor([1, 37, 200, 16, 9]), page, tol=1e-5, pool_tol=1e-6)


def check_against_composed(w, g, lens, page, tol, pool_tol):
    """The kernel on decode rows of ``lens`` tokens (random pages, pool, inputs and RoPE angles)
    against ``_reference``: output within ``tol``, the new K|V rows within ``pool_tol`` and nothing
    else written, and each sequence alone bit for bit what it gave in the batch."""
    m, kv, hd, hidden = len(lens), w.kv_heads, w.head_dim, w.hidden
    pages = int(lens.max() + page - 1) // page
    n_pages = 4096 // page
    perm = torch.randperm(n_pages, generator=g)
    tables = perm[:m * pages].view(m, pages).contiguous()
    slots = tables.gather(1, ((lens - 1) // page)[:, None])[:, 0] * page + (lens - 1) % page
    pool = torch.randn(n_pages * page, 2 * kv * hd, generator=g)
    h = torch.randn(m, hidden, generator=g)
    pos = (lens - 1).float()[:, None] * torch.rand(hd // 2, generator=g)[None]
    cos, sin = torch.cat((pos, pos), -1).cos(), torch.cat((pos, pos), -1).sin()
    want_pool = pool.clone()
    want = _reference(h, w, cos, sin, want_pool, slots, tables, lens, page)
    got = decode_layer.decode_layer(h, w, cos, sin, pool, slots, tables, lens, page, hd ** -0.5)
    torch.testing.assert_close(got, want, rtol=tol, atol=tol)
    torch.testing.assert_close(pool, want_pool, rtol=pool_tol, atol=pool_tol)   # the new K|V rows, nothing else
    for b in range(m):
        alone = decode_layer.decode_layer(h[b:b + 1], w, cos[b:b + 1], sin[b:b + 1], pool.clone(), slots[b:b + 1],
                                          tables[b:b + 1], lens[b:b + 1], page, hd ** -0.5)
        assert torch.equal(alone, got[b:b + 1])


@pytest.mark.skipif(decode_layer._VARIANTS.unavailable("avx512") is not None,
                    reason="the AVX-512 build needs a CPU with avx512f")
@pytest.mark.parametrize("kind", ["float32", "int8", "w8a8"])
def test_the_avx512_build_equals_the_avx2_build_bit_for_bit(monkeypatch, kind):
    """The layer built with AVX-512 (its linears up to 8 rows per pass, two weight rows per
    vector) gives the AVX2 build's bits, output and pool, at 1, 5 and 11 rows."""
    g = torch.Generator().manual_seed(7)
    w = _layer(g, 48, 136, 6, 2, 32, True, kind)
    page = 16
    for rows in (1, 5, 11):
        lens = torch.randint(1, 300, (rows,), generator=g)
        pages = int(lens.max() + page - 1) // page
        tables = torch.randperm(4096 // page, generator=g)[:rows * pages].view(rows, pages).contiguous()
        slots = tables.gather(1, ((lens - 1) // page)[:, None])[:, 0] * page + (lens - 1) % page
        pool, h = torch.randn(4096, 2 * 2 * 32, generator=g), torch.randn(rows, 48, generator=g)
        pos = (lens - 1).float()[:, None] * torch.rand(16, generator=g)[None]
        cos, sin = torch.cat((pos, pos), -1).cos(), torch.cat((pos, pos), -1).sin()
        got = {}
        for variant in ("avx2", "avx512"):
            monkeypatch.setattr(decode_layer, "_function", lambda v=variant: decode_layer._variant_function(v))
            p = pool.clone()
            got[variant] = (decode_layer.decode_layer(h, w, cos, sin, p, slots, tables, lens, page, 32 ** -0.5), p)
        assert torch.equal(got["avx512"][0], got["avx2"][0]) and torch.equal(got["avx512"][1], got["avx2"][1])


BF16_WHY_NOT = decode_layer.bf16_unavailable()
needs_bf16_layer = pytest.mark.skipif(BF16_WHY_NOT is not None, reason=f"bf16 layer kernel: {BF16_WHY_NOT}")


def _separate_bf16(h, w, cos, sin, pool, slots, tables, lens, page):
    """The bf16 layer as the engine composes it from the separate native ops (AMX linears,
    RMSNorm and RoPE kernels, the paged attention kernel) and torch's bf16 adds and SiLU."""
    from flashlane.kernels.native import norm_rope, paged_attention, row_gemm

    ln1, ln2, lq, lk, lv, lo, lg, lu, ld = w.tensors
    m, heads, kv, hd = h.shape[0], w.heads, w.kv_heads, w.head_dim

    def mm(lin, x):
        return row_gemm.linear(x, lin.weight, None if lin.bias is None else lin.bias.bfloat16())

    x = norm_rope.rms_norm(h, ln1, w.eps)
    q = norm_rope.rope_rotate_half(mm(lq, x).view(m, heads, hd), cos, sin)
    k = norm_rope.rope_rotate_half(mm(lk, x).view(m, kv, hd), cos, sin)
    v = mm(lv, x).view(m, kv, hd)
    pool[slots] = torch.cat((k.reshape(m, -1), v.reshape(m, -1)), -1)
    att = paged_attention.decode_attention(q, pool, tables, lens, kv, page)
    h1 = h + mm(lo, att.reshape(m, -1))
    x2 = norm_rope.rms_norm(h1, ln2, w.eps)
    return h1 + mm(ld, F.silu(mm(lg, x2)) * mm(lu, x2))


@needs_bf16_layer
@pytest.mark.parametrize("heads, kv, hd, page, qkv_bias", [(9, 3, 64, 16, False), (4, 2, 16, 1, True),
                                                           (2, 1, 32, 4, True)])
def test_bf16_layer_equals_the_separate_bf16_ops(heads, kv, hd, page, qkv_bias):
    """bf16 weights, activations and pool (dims multiples of the AMX depth): the new K|V rows
    bit for bit those of the separate native ops and nothing else written; the output equal to
    theirs up to SiLU's exp (simd.h's against torch's: at most one bf16 step, rarely); each
    sequence alone bit for bit what it gave in the batch."""
    g = torch.Generator().manual_seed(heads * 10 + hd + page)
    hidden, inter = 96, 160
    mats = [torch.randn(n, k, generator=g) / k ** 0.5 for n, k in
            [(heads * hd, hidden), (kv * hd, hidden), (kv * hd, hidden), (hidden, heads * hd), (inter, hidden),
             (inter, hidden), (hidden, inter)]]
    biases = [0.1 * torch.randn(mat.shape[0], generator=g) if qkv_bias and i < 3 else None
              for i, mat in enumerate(mats)]
    linears = [decode_layer.Linear("bf16", mat.bfloat16(), None, None if b is None else b.bfloat16().float())
               for mat, b in zip(mats, biases)]
    ln1, ln2 = ((1 + 0.1 * torch.randn(hidden, generator=g)).bfloat16() for _ in range(2))
    w = decode_layer.LayerWeights(ln1, ln2, 1e-5, linears, heads, kv, hd)
    assert w.ok
    lens = torch.tensor([1, 37, 200, 16, 9])
    m = len(lens)
    pages = int(lens.max() + page - 1) // page
    n_pages = 4096 // page
    tables = torch.randperm(n_pages, generator=g)[:m * pages].view(m, pages).contiguous()
    slots = tables.gather(1, ((lens - 1) // page)[:, None])[:, 0] * page + (lens - 1) % page
    pool = torch.randn(n_pages * page, 2 * kv * hd, generator=g).bfloat16()
    h = torch.randn(m, hidden, generator=g).bfloat16()
    pos = (lens - 1).float()[:, None] * torch.rand(hd // 2, generator=g)[None]
    cos, sin = torch.cat((pos, pos), -1).cos().bfloat16(), torch.cat((pos, pos), -1).sin().bfloat16()
    want_pool = pool.clone()
    want = _separate_bf16(h, w, cos, sin, want_pool, slots, tables, lens, page)
    got = decode_layer.decode_layer(h, w, cos, sin, pool, slots, tables, lens, page, hd ** -0.5)
    assert got.dtype == torch.bfloat16
    assert torch.equal(pool, want_pool)
    torch.testing.assert_close(got.float(), want.float(), rtol=2 ** -7, atol=2 ** -7)
    assert (got != want).float().mean() < 0.05
    for b in range(m):
        alone = decode_layer.decode_layer(h[b:b + 1], w, cos[b:b + 1], sin[b:b + 1], pool.clone(), slots[b:b + 1],
                                          tables[b:b + 1], lens[b:b + 1], page, hd ** -0.5)
        assert torch.equal(alone, got[b:b + 1])


def test_a_bf16_layer_needs_bf16_linears_with_amx_depth():
    g = torch.Generator().manual_seed(1)
    ln = torch.ones(64).bfloat16()
    mats = [torch.randn(64, 64, generator=g).bfloat16() for _ in range(7)]
    assert not decode_layer.LayerWeights(ln, ln, 1e-5, [decode_layer.Linear("float32", mat.float(), None, None)
                                                        for mat in mats], 4, 4, 16).ok       # float32 kinds
    odd = [decode_layer.Linear("bf16", torch.randn(64, 48, generator=g).bfloat16(), None, None)] * 7
    assert not decode_layer.LayerWeights(ln, ln, 1e-5, odd, 4, 4, 16).ok                        # K 48
    fine = [decode_layer.Linear("bf16", mat, None, None) for mat in mats]
    assert decode_layer.LayerWeights(ln, ln, 1e-5, fine, 4, 4, 16).ok
    assert not decode_layer.LayerWeights(ln.float(), ln.float(), 1e-5, fine, 4, 4, 16).ok      # float32 norms


GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=3)


dtypes: set[torch.dtype] = set()      # the dtypes the fused layer ran in


def _fused_calls(monkeypatch):
    calls = []
    dtypes.clear()
    real = decode_layer.decode_layer
    monkeypatch.setattr(decode_layer, "decode_layer",
                        lambda *a, **k: calls.append(a[0].shape[0]) or dtypes.add(a[0].dtype) or real(*a, **k))
    return calls


def _unfused(monkeypatch):
    monkeypatch.setattr(CpuBackend, "dense_decoder_layer", lambda self, *a, **k: None)


def _close(a, b, tol):
    assert [o.token_ids for o in a] == [o.token_ids for o in b]
    for x, y in zip(a, b):
        for la, lb in zip(x.logprobs, y.logprobs):
            assert all(abs(lb[t] - lp) < tol for t, lp in la.items())


def test_engine_equals_the_separate_native_ops_batched_and_alone(monkeypatch):
    m = tiny_llama(seed=3)
    prompts = random_prompts(5, 3, 90, 250, seed=6)
    calls = _fused_calls(monkeypatch)
    llm = LLM(copy.deepcopy(m), dtype="float32", linear_kernel="native", max_num_batched_tokens=64)
    got = llm.generate(prompts, GREEDY)
    assert calls and max(calls) > 1                        # the fused layer ran, also on batches
    # alone == batched: the prompts' prefill chunks fall differently alone, so the KV differs in
    # the last bits; the layer itself is batch-invariant bit for bit (the kernel test above)
    _close([llm.generate([p], GREEDY)[0] for p in prompts], got, 1e-5)
    _unfused(monkeypatch)
    n = len(calls)
    separate = LLM(copy.deepcopy(m), dtype="float32", linear_kernel="native", max_num_batched_tokens=64)
    _close(separate.generate(prompts, GREEDY), got, 1e-5)
    assert len(calls) == n


@pytest.mark.parametrize("method, kernel", [("int8", "native"), ("w8a8", "w8a8-native")])
def test_int8_layers_equal_the_separate_int8_kernels(monkeypatch, method, kernel):
    monkeypatch.setenv("FLASHLANE_INT8_KERNEL", kernel)
    m = tiny_llama(seed=4)
    prompts = random_prompts(4, 3, 60, 250, seed=6)
    calls = _fused_calls(monkeypatch)
    llm = LLM(copy.deepcopy(m), dtype="float32", linear_kernel="native", quantization=method)
    got = llm.generate(prompts, GREEDY)
    assert calls
    _close([llm.generate([p], GREEDY)[0] for p in prompts], got, 1e-4)
    _unfused(monkeypatch)
    separate = LLM(copy.deepcopy(m), dtype="float32", linear_kernel="native", quantization=method)
    _close(separate.generate(prompts, GREEDY), got, 1e-4)


def test_smollm2_stays_within_1e4_of_torch(monkeypatch):
    m = preset("smollm2-135m")
    prompts = random_prompts(2, 30, 60, 4000, seed=8)
    calls = _fused_calls(monkeypatch)
    got = LLM(copy.deepcopy(m), dtype="float32", linear_kernel="native").generate(prompts, GREEDY)
    assert calls
    plain = LLM(m, dtype="float32", linear_kernel="aten")
    monkeypatch.setattr(plain.engine.ops, "native", False)
    _close(plain.generate(prompts, GREEDY), got, 1e-4)


@needs_bf16_layer
def test_bf16_smollm2_takes_the_fused_layer_and_keeps_the_separate_ops_tokens(monkeypatch):
    """A bf16 model with native linears decodes through the bf16 layer (AMX), batched up to 16
    rows, with the separate native ops' tokens and logprobs within bf16 noise."""
    m = preset("smollm2-135m")
    prompts = random_prompts(3, 20, 40, 4000, seed=8)
    calls = _fused_calls(monkeypatch)
    llm = LLM(bf16_copy(m), linear_kernel="native")
    assert llm.engine.dtype == torch.bfloat16
    got = llm.generate(prompts, GREEDY)
    assert calls and max(calls) == 3 and dtypes == {torch.bfloat16}
    _unfused(monkeypatch)
    n = len(calls)
    separate = LLM(bf16_copy(m), linear_kernel="native")
    want = separate.generate(prompts, GREEDY)
    assert len(calls) == n
    agree = sum(a.token_ids == b.token_ids for a, b in zip(got, want))
    assert agree >= 2, [(a.token_ids, b.token_ids) for a, b in zip(got, want)]
    first = [(a.logprobs[0], b.logprobs[0]) for a, b in zip(got, want)]
    assert all(abs(la[t] - lb[t]) < 0.05 for la, lb in first for t in la if t in lb)


def test_what_it_declines_composes_the_separate_ops(monkeypatch):
    m = tiny_llama(seed=3)
    prompts = random_prompts(3, 3, 20, 250, seed=7)
    calls = _fused_calls(monkeypatch)
    LLM(copy.deepcopy(m), dtype="float32", linear_kernel="aten").generate(prompts, GREEDY)      # torch linears
    monkeypatch.setenv("FLASHLANE_INT8_KERNEL", "int8pack")                                  # a torch int8 kernel
    LLM(copy.deepcopy(m), dtype="float32", linear_kernel="native", quantization="int8").generate(prompts, GREEDY)
    LLM(copy.deepcopy(m), dtype="float32", linear_kernel="native", kv_cache_dtype="int8").generate(prompts, GREEDY)
    off = LLM(copy.deepcopy(m), dtype="float32", linear_kernel="native")
    monkeypatch.setattr(off.engine.ops, "native", False)
    off.generate(prompts, GREEDY)
    assert calls == []
    many = LLM(copy.deepcopy(m), dtype="float32", linear_kernel="native")
    many.generate(random_prompts(20, 3, 8, 250, seed=9), GREEDY)          # 20 decode rows > 16: declined
    assert all(rows <= 16 for rows in calls)


def test_the_backend_names_the_whole_layer_path():
    assert "whole llama decode layers" in CpuBackend().describe()
    if BF16_WHY_NOT is None:
        assert "bf16 on AMX" in CpuBackend().describe()
    assert "whole llama" not in CpuBackend(native=False).describe()
