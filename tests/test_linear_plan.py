"""Float linears' weight format (engine arg linear_kernel): the timed choice, the packed module
against nn.Linear, and the engine with packed weights against the engine without."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from engine_models import preset, random_prompts, small_glm, tiny_llama
from flashlane.engine.llm import LLM
from flashlane.engine.sampling_params import SamplingParams
from flashlane.kernels.backends import select_backend
from flashlane.kernels.linear_plan import (CHOICES, DECODE_SHAPE, LinearPlan, choose_linear_plan, linear,
                                           native_rows, pack_weight, unavailable)
from flashlane.models.packed_linear import KernelLinear, PackedLinear, pack_linears

ONEDNN = unavailable("onednn", torch.float32) is None
needs_onednn = pytest.mark.skipif(not ONEDNN, reason="this torch build has no oneDNN")
NATIVE_WHY_NOT = unavailable("native", torch.float32)
needs_native = pytest.mark.skipif(NATIVE_WHY_NOT is not None, reason=f"native kernel: {NATIVE_WHY_NOT}")
BF16_WHY_NOT = unavailable("native", torch.bfloat16)
needs_native_bf16 = pytest.mark.skipif(BF16_WHY_NOT is not None, reason=f"native bf16 kernel: {BF16_WHY_NOT}")
PACKED_FORMATS = [pytest.param("onednn", marks=needs_onednn), pytest.param("native", marks=needs_native)]
GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)


def _timer(decode: float, batch: float, prefill: float, native: tuple[float, float] = (1.0, 1.0),
           chunk: float = 1.0):
    """A fake timer: aten takes 1 s everywhere, onednn the given seconds per row class (``chunk``:
    at a prefill chunk's 1024 rows), native ``native`` at 1 row and at its batch class's rows."""
    def timer(fmt, rows, shape, dtype):
        if fmt == "native":
            return 1.0, dict(zip((1, native_rows(dtype)[0][1][1]), native))[rows]
        return 1.0, {1: decode, 16: batch, 128: prefill, 1024: chunk}[rows]
    return timer


# ---- the choice ---------------------------------------------------------------------------------

def test_a_format_is_timed_in_turn_with_aten_on_the_same_weight(monkeypatch):
    """Side by side: a warm-up call each, then ROUNDS calls each in ABBA order, the fastest call of
    each returned, so a burst of other work lands on both sides."""
    from flashlane.kernels import linear_plan

    calls = []
    monkeypatch.setattr(linear_plan, "linear", lambda fmt, x, packed, bias: calls.append((fmt, packed.data_ptr())))
    aten_s, native_s = linear_plan.measure_beside_aten("native", 2, (16, 8), torch.float32)
    pairs = [["aten", "native"] if r % 2 == 0 else ["native", "aten"] for r in range(linear_plan.ROUNDS)]
    assert [f for f, _ in calls] == ["aten", "native"] + sum(pairs, [])
    assert len({ptr for _, ptr in calls}) == 1              # native multiplies the weight as loaded: the same one
    assert 0 < aten_s < 1 and 0 < native_s < 1


@needs_onednn
@pytest.mark.parametrize("times, want", [
    ((1.0, 0.6, 0.6), "onednn"),      # equal at decode, faster in batches
    ((1.04, 0.8, 0.8), "onednn"),     # within the decode noise allowance
    ((1.2, 0.5, 0.5), "aten"),        # slower at decode: decode is what streams the weights
    ((0.9, 0.95, 0.95), "aten"),      # not 10% faster in batches: not worth a different layout
    ((1.0, 0.6, 0.6, (1.0, 1.0), 1.2), "aten"),   # slower at a prefill chunk (Zen 3, 2 threads)
])
def test_auto_takes_onednn_only_where_it_is_no_slower_at_decode_and_faster_in_batches(times, want,
                                                                                         monkeypatch):
    monkeypatch.delenv("FLASHLANE_LINEAR_KERNEL", raising=False)
    plan = choose_linear_plan("auto", torch.float32, timer=_timer(*times))
    assert plan.format == want
    assert "chunk (1024 rows" in plan.why
    assert "timed:" in plan.why and "decode (1 rows" in plan.why and f"{DECODE_SHAPE[0]}x{DECODE_SHAPE[1]}" in plan.why


@needs_native
@pytest.mark.parametrize("native, onednn, want", [
    ((1.04, 0.6), (1.2, 1.0, 1.0), "native"),     # no slower at decode, faster at 8 rows
    ((1.15, 0.5), (1.2, 1.0, 1.0), "aten"),       # slower at decode: decode is what streams the weights
    ((1.09, 0.5), (1.2, 1.0, 1.0), "native"),     # within 10% at decode: the same bandwidth-bound read
    ((0.8, 0.95), (1.2, 1.0, 1.0), "aten"),       # not 10% faster at 8 rows (batched decode)
    ((0.9, 0.6), (0.85, 0.6, 0.6), "native"),     # both qualify: native (whole decode layers, aten chunks)
    ((0.8, 0.6), (1.0, 0.6, 0.6), "native"),
])
def test_auto_takes_native_only_where_it_is_no_slower_at_decode_and_faster_in_small_batches(
        native, onednn, want, monkeypatch):
    monkeypatch.delenv("FLASHLANE_LINEAR_KERNEL", raising=False)
    timer = _timer(*onednn, native=native)
    if not ONEDNN:
        want = "aten" if want == "onednn" else want
    plan = choose_linear_plan("auto", torch.float32, timer=timer)
    assert plan.format == want
    assert "native/aten decode" in plan.why and "8 rows" in plan.why


def test_native_is_refused_by_name_where_it_cannot_run(monkeypatch):
    from flashlane.kernels.native import row_gemm

    monkeypatch.delenv("FLASHLANE_LINEAR_KERNEL", raising=False)
    with pytest.raises(ValueError, match="'native' cannot run here: .*float32 or bfloat16 weights, not torch.float16"):
        choose_linear_plan("native", torch.float16)
    with pytest.raises(ValueError, match="linear_kernel 'native' cannot run here: .*CPU kernel"):
        choose_linear_plan("native", torch.float32, "meta")
    monkeypatch.setattr(row_gemm, "bf16_unavailable", lambda: "the CPU lacks avx512_bf16")
    with pytest.raises(ValueError, match="'native' cannot run here: the CPU lacks avx512_bf16"):
        choose_linear_plan("native", torch.bfloat16)
    plan = choose_linear_plan("auto", torch.bfloat16, timer=_timer(1.2, 1.0, 1.0, native=(0.1, 0.1)))
    assert plan.format != "native" and "native: the CPU lacks avx512_bf16" in plan.why


def test_bf16_native_needs_avx512_bf16_by_name():
    from flashlane.kernels.cpu_caps import CpuCaps
    from flashlane.kernels.native import row_gemm

    avx512 = CpuCaps("AVX512", frozenset({"avx2", "fma", "f16c", "avx512f", "avx512bw"}))
    assert row_gemm.bf16_cpu_unavailable(avx512) == "the CPU lacks avx512_bf16"
    assert row_gemm.bf16_cpu_unavailable(CpuCaps("AVX512", avx512.flags | {"avx512_bf16"})) is None


@pytest.mark.parametrize("native, want", [
    ((0.5, 0.8), "native"),       # 10% faster at 1 row, no slower at its batch rows
    ((0.95, 0.5), "aten"),        # not 10% faster at 1 row: bf16's native is meant for decode
    ((0.5, 1.15), "aten"),        # slower at its batch rows
])
@pytest.mark.parametrize("amx, batch_rows", [(None, 8), ("the CPU lacks amx_tile", 2)])
def test_auto_takes_bf16_native_where_it_is_faster_at_one_row_and_no_slower_at_its_batch(
        native, want, amx, batch_rows, monkeypatch):
    """With AMX the kernel takes up to 16 rows and is timed at 8; with the dot-product kernel only,
    at the 2 rows it takes."""
    from flashlane.kernels.native import row_gemm

    monkeypatch.delenv("FLASHLANE_LINEAR_KERNEL", raising=False)
    monkeypatch.setattr(row_gemm, "bf16_unavailable", lambda: None)
    monkeypatch.setattr(row_gemm, "amx_unavailable", lambda: amx)
    plan = choose_linear_plan("auto", torch.bfloat16, timer=_timer(1.2, 1.0, 1.0, native=native))
    assert plan.format == want
    assert "native/aten decode" in plan.why and f"{batch_rows} rows" in plan.why


@needs_native_bf16
@pytest.mark.parametrize("n, k, rows", [(64, 48, 1), (577, 100, 2), (3, 33, 2), (40, 1000, 1)])
def test_bf16_native_kernel_rounds_float32_sums_and_is_batch_invariant(n, k, rows):
    """bf16 x and weights, float32 sums rounded once to bf16: within one bf16 rounding of the
    float32 product (plus float32 summation noise); a row alone equals the same row in the call;
    more rows than it takes go to torch."""
    from flashlane.kernels.native import row_gemm

    gen = torch.Generator().manual_seed(n + k)
    w, x = torch.randn(n, k, generator=gen).bfloat16(), torch.randn(rows, k, generator=gen).bfloat16()
    bias = torch.randn(n, generator=gen).bfloat16()
    out = linear("native", x, w, bias)
    want = x.float() @ w.float().T + bias.float()
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), want, rtol=2 ** -8, atol=1e-3 * k ** 0.5)
    assert torch.equal(torch.cat([linear("native", x[i:i + 1], w, bias) for i in range(rows)]), out)
    more = torch.randn(row_gemm.max_rows(torch.bfloat16) + 1, k, generator=gen).bfloat16()
    assert torch.equal(linear("native", more, w, bias), torch.nn.functional.linear(more, w, bias))


@needs_native_bf16
def test_bf16_native_engine_greedy_is_the_same_batched_and_alone():
    m = copy.deepcopy(tiny_llama())
    m.model.to(torch.bfloat16)             # the engine keeps a given model's dtype
    prompts = random_prompts(4, 5, 70, min(m.config.vocab_size, 4000), seed=3)
    llm = LLM(m, linear_kernel="native", max_num_batched_tokens=64)
    assert llm.engine.dtype == torch.bfloat16 and llm.engine.info.linear_kernel["format"] == "native"
    batched = [o.token_ids for o in llm.generate(prompts[:2], GREEDY)]   # 2 decode rows: the kernel's
    assert [llm.generate([p], GREEDY)[0].token_ids for p in prompts[:2]] == batched


def test_named_pinned_and_impossible_choices(monkeypatch):
    monkeypatch.delenv("FLASHLANE_LINEAR_KERNEL", raising=False)
    assert choose_linear_plan("aten", torch.float32) == LinearPlan("aten", "chosen by name")
    with pytest.raises(ValueError, match="linear_kernel must be one of auto, aten, onednn"):
        choose_linear_plan("mkl", torch.float32)
    with pytest.raises(ValueError, match="linear_kernel 'onednn' cannot run here: .*CPU format"):
        choose_linear_plan("onednn", torch.float32, "meta")
    assert choose_linear_plan("auto", torch.float32, "meta").format == "aten"     # never timed
    with pytest.raises(ValueError, match="linear_kernel 'onednn' cannot run here: .*float16"):
        choose_linear_plan("onednn", torch.float16)
    monkeypatch.setenv("FLASHLANE_LINEAR_KERNEL", "aten")
    assert choose_linear_plan("auto", torch.float32).why == "pinned by FLASHLANE_LINEAR_KERNEL"
    monkeypatch.setenv("FLASHLANE_LINEAR_KERNEL", "fast")
    with pytest.raises(ValueError, match="FLASHLANE_LINEAR_KERNEL='fast'"):
        choose_linear_plan("auto", torch.float32)


def test_engine_args_name_the_field():
    with pytest.raises(ValueError, match="linear_kernel must be one of 'auto', 'aten', 'onednn', 'native'"):
        LLM(tiny_llama(), dtype="float32", linear_kernel="fast")


# ---- the packed module --------------------------------------------------------------------------

@needs_onednn
@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_equals_nn_linear_for_any_row_count_and_leading_shape(bias):
    torch.manual_seed(0)
    ref = nn.Linear(96, 80, bias=bias)
    packed = PackedLinear(copy.deepcopy(ref), "onednn", select_backend("cpu"))
    for shape in ((1, 96), (7, 96), (130, 96), (2, 5, 96)):
        x = torch.randn(shape)
        torch.testing.assert_close(packed(x), ref(x), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(packed.weight, ref.weight.detach(), rtol=0, atol=0)   # unpacks exactly
    twin = copy.deepcopy(packed)                        # an opaque tensor has no storage: re-packed
    x = torch.randn(3, 96)
    assert torch.equal(twin(x), packed(x)) and twin.packed is not packed.packed


@needs_onednn
def test_pack_linears_replaces_plain_linears_and_counts_a_tied_heads_copy():
    m = copy.deepcopy(tiny_llama()).model
    m.lm_head.weight = m.model.embed_tokens.weight                 # tied, as SmolLM2's head is
    n_linear = sum(type(x) is nn.Linear for x in m.modules())
    report = pack_linears(m, LinearPlan("onednn", "test"), select_backend("cpu"))
    assert report.linears == n_linear and not any(type(x) is nn.Linear for x in m.modules())
    head = m.model.embed_tokens.weight
    assert report.extra_bytes == head.numel() * head.element_size()
    assert "onednn" in report.describe() and "tied weights" in report.describe()
    assert pack_linears(m, LinearPlan("aten", "test"), select_backend("cpu")).linears == 0


@needs_native
def test_native_keeps_the_loaded_weights_and_a_tied_head_shares_the_embedding():
    m = copy.deepcopy(tiny_llama()).model
    m.lm_head.weight = m.model.embed_tokens.weight
    x = torch.randn(2, m.config.hidden_size)
    want = m.lm_head(x)
    names = set(m.state_dict())
    report = pack_linears(m, LinearPlan("native", "test"), select_backend("cpu"))
    assert report.linears > 0 and report.extra_bytes == 0 and "tied weights" not in report.describe()
    assert type(m.lm_head) is KernelLinear and m.lm_head.weight is m.model.embed_tokens.weight
    assert set(m.state_dict()) == names                        # the weights stay parameters
    torch.testing.assert_close(m.lm_head(x), want, rtol=1e-5, atol=1e-5)
    twin = copy.deepcopy(m)
    assert twin.lm_head.weight is twin.model.embed_tokens.weight and twin.lm_head.ops is m.lm_head.ops
    torch.testing.assert_close(twin.lm_head(x), want, rtol=1e-5, atol=1e-5)


@needs_onednn
def test_the_kernel_matches_aten_on_bfloat16_where_onednn_packs_it():
    if unavailable("onednn", torch.bfloat16):
        pytest.skip("oneDNN cannot pack bfloat16 on this CPU (needs AVX512BW/VL/DQ or AVX-NE-CONVERT)")
    torch.manual_seed(0)
    w, x = torch.randn(64, 48).bfloat16(), torch.randn(5, 48).bfloat16()
    torch.testing.assert_close(linear("onednn", x, pack_weight("onednn", w), None).float(),
                               (x.float() @ w.float().T), rtol=2e-2, atol=2e-2)


# ---- the engine -------------------------------------------------------------------------------

def _model(name):
    if name == "tiny-llama":
        return tiny_llama()
    if name.startswith("small-"):
        return small_glm(name.removeprefix("small-"))
    return preset(name)


@pytest.mark.parametrize("fmt", PACKED_FORMATS)
@pytest.mark.parametrize("name", ["tiny-llama", "tiny-flash", "tiny-standard", "small-glm5_next"])
def test_packed_engine_greedy_equals_aten_batched_and_alone(name, fmt):
    m = _model(name)
    prompts = random_prompts(4, 5, 70, min(m.config.vocab_size, 4000), seed=3)
    want = [o.token_ids for o in LLM(m, dtype="float32", linear_kernel="aten", max_num_batched_tokens=64)
            .generate(prompts, GREEDY)]
    packed = LLM(copy.deepcopy(m), dtype="float32", linear_kernel=fmt, max_num_batched_tokens=64)
    info = packed.engine.info.linear_kernel
    assert info["format"] == fmt and info["linears"] > 0 and info["why"] == "chosen by name"
    assert [o.token_ids for o in packed.generate(prompts, GREEDY)] == want                  # batched
    assert [packed.generate([p], GREEDY)[0].token_ids for p in prompts] == want            # alone


@needs_onednn
def test_packed_mtp_layer_drafts_and_the_ids_stay_those_of_speculation_off():
    """The MTP layer's linears are packed too; its drafts still verify to the plain greedy ids."""
    m = small_glm("glm5_next", seed=4, mtp=True)
    prompts = random_prompts(3, 10, 40, 256, seed=6)
    want = [o.token_ids for o in LLM(m, dtype="float32", linear_kernel="aten").generate(prompts, GREEDY)]
    spec = LLM(copy.deepcopy(m), dtype="float32", linear_kernel="onednn", cache_memory=64 << 20,
               speculative_config={"method": "mtp", "num_speculative_tokens": 2})
    mtp_layer = spec.engine.model.model.language_model.layers[m.config.num_layers]
    assert any(type(x) is PackedLinear for x in mtp_layer.modules())
    assert [o.token_ids for o in spec.generate(prompts, GREEDY)] == want
    assert spec.engine.stats().get("spec_draft_tokens", 0) > 0       # (random weights: few are accepted)


@pytest.mark.parametrize("fmt", PACKED_FORMATS)
def test_packed_logits_stay_within_1e4_of_aten_on_smollm2(fmt):
    m = preset("smollm2-135m")
    prompt = random_prompts(1, 40, 40, 4000, seed=5)[0]
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logprobs=5)
    a = LLM(m, dtype="float32", linear_kernel="aten").generate([prompt], params)[0]
    b = LLM(copy.deepcopy(m), dtype="float32", linear_kernel=fmt).generate([prompt], params)[0]
    assert a.token_ids == b.token_ids
    for la, lb in zip(a.logprobs, b.logprobs):
        for tok, lp in la.items():
            assert abs(lb[tok] - lp) < 1e-4


def test_auto_on_a_model_it_loads_is_timed_and_reported():
    llm = LLM("tiny-flash", dtype="float32")
    info = llm.engine.info.linear_kernel
    assert info["why"].startswith("timed:") or "FLASHLANE_LINEAR_KERNEL" in info["why"]
    assert (info["linears"] > 0) == (info["format"] != "aten")
    assert llm.engine.startup["linear_kernel"] == info
    assert f"linears {info['format']}" in llm.engine.describe_weights()


def test_auto_leaves_a_given_model_object_alone_and_says_so():
    llm = LLM(tiny_llama(), dtype="float32")
    info = llm.engine.info.linear_kernel
    assert info["format"] == "aten" and info["linears"] == 0 and "model object" in info["why"]
    assert any(type(x) is nn.Linear for x in tiny_llama().model.modules())
    assert "linears aten" in llm.engine.describe_weights()


def test_the_serve_flag_reaches_the_engine_args():
    import argparse

    from flashlane.cli.engine_flags import add_engine_flags, engine_kwargs

    p = argparse.ArgumentParser()
    add_engine_flags(p)
    assert engine_kwargs(p.parse_args([]))["linear_kernel"] == "auto"
    assert engine_kwargs(p.parse_args(["--linear-kernel", "onednn"]))["linear_kernel"] == "onednn"
    assert engine_kwargs(p.parse_args(["--linear-kernel", "native"]))["linear_kernel"] == "native"
    flag = next(a for a in p._actions if "--linear-kernel" in a.option_strings)
    assert tuple(flag.choices) == CHOICES
    with pytest.raises(SystemExit):
        p.parse_args(["--linear-kernel", "mkl"])
