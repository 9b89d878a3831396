"""Native decode attention straight from the paged pool (``kernels/native/paged_attention``)
against the gather + SDPA path it replaces; the cpu backend's native switch; and the engine with
the native kernels (attention, RMSNorm, RoPE) against the engine without them."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from engine_models import preset, random_prompts, tiny_llama
from flashlane.engine.llm import LLM
from flashlane.engine.sampling_params import SamplingParams
from flashlane.kernels.backends.cpu.backend import CpuBackend
from flashlane.kernels.native import paged_attention

WHY_NOT = paged_attention.unavailable()
needs_native = pytest.mark.skipif(WHY_NOT is not None, reason=f"native kernel unavailable: {WHY_NOT}")
GREEDY = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)


def _reference(q, pool, tables, lens, num_kv, page):
    """Gather each history from the pool and attend with SDPA under a length mask."""
    bsz, num_heads, d = q.shape
    t = int(lens.max())
    pos = torch.arange(t)
    rows = tables.gather(1, (pos // page).expand(bsz, -1)) * page + pos % page
    kv = pool[rows].view(bsz, t, 2, num_kv, d)
    mask = (pos[None, :] < lens[:, None])[:, None, None, :]
    out = F.scaled_dot_product_attention(q[:, :, None], kv[:, :, 0].transpose(1, 2), kv[:, :, 1].transpose(1, 2),
                                         attn_mask=mask, enable_gqa=True)
    return out[:, :, 0]


@needs_native
@pytest.mark.parametrize("num_heads, num_kv, d", [(9, 3, 64), (4, 4, 16), (8, 2, 128), (6, 1, 8), (2, 2, 72)])
@pytest.mark.parametrize("page", [1, 16])
def test_matches_gather_and_sdpa_for_any_lengths_and_head_layout(num_heads, num_kv, d, page):
    g = torch.Generator().manual_seed(num_heads * 100 + d + page)
    pool = torch.randn(4096, 2 * num_kv * d, generator=g)
    lens = torch.tensor([1, 37, 200, 16])
    pages = int(lens.max() + page - 1) // page
    tables = torch.stack([torch.randperm(4096 // page, generator=g)[:pages] for _ in lens])
    q = torch.randn(len(lens), num_heads, d, generator=g)
    got = paged_attention.decode_attention(q, pool, tables, lens, num_kv, page)
    torch.testing.assert_close(got, _reference(q, pool, tables, lens, num_kv, page), rtol=1e-5, atol=1e-5)
    alone = paged_attention.decode_attention(q[2:3], pool, tables[2:3], lens[2:3], num_kv, page)
    torch.testing.assert_close(alone, got[2:3], rtol=1e-6, atol=1e-6)


@needs_native
@pytest.mark.parametrize("num_heads, num_kv, d", [(9, 3, 64), (2, 2, 72)])
def test_a_bf16_pool_is_read_in_place_and_summed_in_float32(num_heads, num_kv, d):
    """A bf16 model's pool: its values widened exactly, float32 sums, the output rounded once to
    the query's dtype: within one bf16 rounding of float32 gather + SDPA on the same values."""
    g = torch.Generator().manual_seed(d)
    pool = torch.randn(1024, 2 * num_kv * d, generator=g).bfloat16()
    lens = torch.tensor([1, 37, 200])
    tables = torch.stack([torch.randperm(64, generator=g)[:13] for _ in lens])
    q = torch.randn(len(lens), num_heads, d, generator=g).bfloat16()
    got = paged_attention.decode_attention(q, pool, tables, lens, num_kv, 16)
    want = _reference(q.float(), pool.float(), tables, lens, num_kv, 16)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want, rtol=2 ** -8, atol=1e-5)
    assert torch.equal(paged_attention.decode_attention(q[1:2], pool, tables[1:2], lens[1:2], num_kv, 16), got[1:2])
    assert paged_attention.supports(q, pool, None) == (WHY_NOT is None)


@needs_native
def test_both_builds_match_sdpa_and_only_bf16_pools_run_sixteen_lanes():
    """The avx512 build runs bf16 pools (head dim a multiple of 16) sixteen lanes at a time: within
    float32 rounding of the avx2 build and of SDPA, batch-invariant; float32 pools, and head dims
    of 8 modulo 16, run the avx2 build's code in it, bit for bit."""
    if paged_attention.unavailable("avx512") is not None:
        pytest.skip(f"the avx512 build cannot run here: {paged_attention.unavailable('avx512')}")
    assert paged_attention.best_variant() == "avx512"
    g = torch.Generator().manual_seed(5)
    lens = torch.tensor([1, 15, 16, 17, 300, 577])
    tables = torch.stack([torch.randperm(64, generator=g)[:37] for _ in lens])
    for d, dtype in ((64, torch.bfloat16), (32, torch.bfloat16), (72, torch.bfloat16), (64, torch.float32)):
        pool = torch.randn(1024, 2 * 3 * d, generator=g).to(dtype)
        q = torch.randn(len(lens), 9, d, generator=g)
        wide = paged_attention.decode_attention(q, pool, tables, lens, 3, 16, variant="avx512")
        narrow = paged_attention.decode_attention(q, pool, tables, lens, 3, 16, variant="avx2")
        torch.testing.assert_close(wide, _reference(q, pool.float(), tables, lens, 3, 16), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(wide, narrow, rtol=1e-5, atol=1e-6)
        assert torch.equal(wide, narrow) == (dtype == torch.float32 or d % 16 != 0), (d, dtype)
        for b in (0, 4, 5):
            alone = paged_attention.decode_attention(q[b:b + 1], pool, tables[b:b + 1], lens[b:b + 1], 3, 16,
                                                     variant="avx512")
            assert torch.equal(alone, wide[b:b + 1])


@needs_native
@pytest.mark.parametrize("pool_dtype", [torch.float32, torch.bfloat16])
def test_a_peaked_softmax_flushes_its_denormal_tail_without_changing_the_result(pool_dtype):
    """Scores 87 and more below the max give denormal probabilities; the kernel flushes them for
    its call (microcode assists made it 2.4x slower) and leaves the thread's float mode as it was."""
    g = torch.Generator().manual_seed(11)
    pool = torch.randn(1024, 2 * 3 * 64, generator=g).to(pool_dtype)
    lens = torch.tensor([700, 33, 1000])
    tables = torch.stack([torch.randperm(64, generator=g)[:63] for _ in lens])
    q = (torch.randn(3, 9, 64, generator=g) * 40).to(pool_dtype)
    got = paged_attention.decode_attention(q, pool, tables, lens, 3, 16)
    want = _reference(q.float(), pool.float(), tables, lens, 3, 16)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got.float(), want, rtol=2 ** -8, atol=1e-5)
    assert (torch.tensor([1e-38]) / 100).item() != 0.0       # denormals still on for the caller


def test_what_it_declines_goes_to_torch():
    q, pool = torch.randn(2, 4, 16), torch.randn(64, 128)
    assert not paged_attention.supports(q.half(), pool, None)
    assert not paged_attention.supports(q, pool.half(), None)
    assert not paged_attention.supports(q, pool, torch.ones(64, 2))          # int8 pool with scales
    assert not paged_attention.supports(torch.randn(2, 4, 12), pool, None)   # head dim not a multiple of 8
    assert paged_attention.supports(q, pool, None) == (WHY_NOT is None)
    with pytest.raises(ValueError, match="not a multiple of 3 kv heads"):
        paged_attention.decode_attention(torch.randn(1, 4, 16), torch.randn(64, 96),
                                         torch.zeros(1, 4, dtype=torch.long), torch.tensor([3]), 3, 16)


@needs_native
def test_the_backend_says_which_decode_attention_it_runs():
    assert CpuBackend().native
    assert "native decode attention" in CpuBackend().describe()
    off = CpuBackend(native=False)
    assert not off.native and "torch SDPA" in off.describe()
    with pytest.raises(ValueError, match="native kernels cannot run here: device meta"):
        CpuBackend("meta", native=True)


def _without_native(monkeypatch, llm):
    """The engine's backend (one instance per process and device) with the native path off."""
    monkeypatch.setattr(llm.engine.ops, "native", False)


@needs_native
def test_engine_greedy_ids_equal_the_sdpa_path_batched_and_alone(monkeypatch):
    m = tiny_llama(seed=2)
    prompts = random_prompts(5, 3, 90, 250, seed=4)
    native = LLM(copy.deepcopy(m), dtype="float32", max_num_batched_tokens=64)
    assert native.engine.ops.native
    got = [o.token_ids for o in native.generate(prompts, GREEDY)]
    assert [native.generate([p], GREEDY)[0].token_ids for p in prompts] == got
    plain = LLM(m, dtype="float32", max_num_batched_tokens=64)
    _without_native(monkeypatch, plain)
    assert [o.token_ids for o in plain.generate(prompts, GREEDY)] == got


@needs_native
def test_smollm2_logprobs_stay_within_1e4_of_the_sdpa_path(monkeypatch):
    m = preset("smollm2-135m")
    prompts = random_prompts(2, 30, 60, 4000, seed=8)
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, logprobs=5)
    got = LLM(copy.deepcopy(m), dtype="float32").generate(prompts, params)
    plain = LLM(m, dtype="float32")
    _without_native(monkeypatch, plain)
    want = plain.generate(prompts, params)
    for a, b in zip(want, got):
        assert a.token_ids == b.token_ids
        for la, lb in zip(a.logprobs, b.logprobs):
            for tok, lp in la.items():
                assert abs(lb[tok] - lp) < 1e-4
