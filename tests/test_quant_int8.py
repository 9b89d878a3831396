"""int8 everywhere: the kernels against their dequantised references, the grouped int8 expert
matmul, quantize() on the GLM presets (experts and head included), the engine against fp32,
SmolLM2 still answering, and the CPU-capability choices with injected machines."""

import copy
import functools
import os
from types import SimpleNamespace

import pytest
import torch

from flashlane import LLM, SamplingParams
from flashlane.kernels.cpu_caps import CpuCaps, choose_cpu_dtype
from flashlane.kernels.int8_plan import Int8Plan, candidates, choose_plan
from flashlane.kernels.moe import experts_fixed_shape, grouped_experts, grouped_experts_int8
from flashlane.kernels.quant_matmul import (KERNELS, dequantize_int8, int8_linear_reference, quantize_int8,
                                            w8a8_linear, w8a8_linear_reference)
from flashlane.models.layers import Experts, Fp32Linear
from flashlane.models.quantize import KERNEL_ENV, Int8Embedding, Int8Experts, Int8Linear, quantize, weight_bytes

from engine_models import preset, random_prompts, small_glm, tiny_llama

AVX2 = CpuCaps("AVX2", frozenset({"avx", "avx2", "fma", "f16c"}))
AVX512_VNNI = CpuCaps("AVX512", frozenset({"avx512f", "avx512_vnni"}))
AMX = CpuCaps("AVX512", frozenset({"avx512f", "avx512_vnni", "avx512_bf16", "amx_int8", "amx_bf16"}))


TRACK_PARAMS = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True, prompt_logprobs=0)


def _plan(kernel: str, method: str = "int8") -> Int8Plan:
    return Int8Plan(method, (kernel,) * 3, "fixed by the test")


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).abs().max() / b.double().abs().max()).item()


# ---- kernels -----------------------------------------------------------------------------------

def test_quantize_int8_is_per_row_and_per_expert():
    torch.manual_seed(0)
    w = torch.randn(3, 10, 7)
    w[1, 4] *= 100                               # one loud row must not coarsen the others
    q, scale = quantize_int8(w)
    assert q.dtype == torch.int8 and scale.shape == (3, 10)
    assert (q.abs().amax(-1) == 127).all()       # every row uses the full range
    assert ((dequantize_int8(q, scale) - w).abs() <= scale[..., None] / 2 + 1e-6).all()


@pytest.mark.parametrize("shape", [(5, 64, 48), (3, 63, 47), (1, 32, 16), (4, 1, 5)])
def test_int8_kernels_match_their_dequantised_references(shape):
    m, k, n = shape
    torch.manual_seed(1)
    x, w, b = torch.randn(2, m, k), torch.randn(n, k), torch.randn(n)   # [..., in] inputs with a bias
    q, scale = quantize_int8(w)
    ref = int8_linear_reference(x, q, scale, b)
    assert ref.shape == (2, m, n)
    assert _rel(KERNELS["dequant-fp32"](x, q, scale, b), ref) < 1e-5
    for name in ("int8pack", "dequant-bf16"):      # bf16 activations: bf16 rounding, no more
        out = KERNELS[name](x, q, scale, b)
        assert out.dtype == x.dtype and _rel(out, ref) < 2e-2, name
    # W8A8: exact int32 accumulation, so equal to the fp64 product of the dequantised operands
    out = w8a8_linear(x, q, scale, b)
    assert out.shape == (2, m, n) and _rel(out, w8a8_linear_reference(x, q, scale, b)) < 1e-5
    assert _rel(out, x @ w.t() + b) < 5e-2         # and it still approximates the float product


def _experts(e=4, h=32, i=16, n=11, k=2, seed=2):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, h, generator=g)
    gate_up, down = torch.randn(e, 2 * i, h, generator=g) * 0.2, torch.randn(e, h, i, generator=g) * 0.2
    ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(n)])
    ids[:, 0] = torch.where(ids[:, 0] == e - 1, 0, ids[:, 0])   # expert e-1 only as a second choice
    weights = torch.rand(n, k, generator=g)
    return x, weights, ids, gate_up, down


def test_grouped_int8_experts_equal_dequantised_reference():
    x, weights, ids, gate_up, down = _experts()
    (gq, gs), (dq, ds) = quantize_int8(gate_up), quantize_int8(down)
    ref = grouped_experts(x, weights, ids, dequantize_int8(gq, gs), dequantize_int8(dq, ds), swiglu_limit=7.0)
    exact = grouped_experts_int8(x, weights, ids, gq, gs, dq, ds, 7.0, linear=int8_linear_reference)
    assert _rel(exact, ref) < 1e-6                              # dispatch and per-expert scales
    packed = grouped_experts_int8(x, weights, ids, gq, gs, dq, ds, 7.0)   # the packed int8 kernel
    assert _rel(packed, ref) < 2e-2
    per_expert_w8a8 = grouped_experts_int8(x, weights, ids, gq, gs, dq, ds, 7.0, linear=w8a8_linear)
    assert _rel(per_expert_w8a8, grouped_experts_int8(x, weights, ids, gq, gs, dq, ds, 7.0,
                                                      linear=w8a8_linear_reference)) < 1e-5


# ---- quantize() on models ---------------------------------------------------------------------

@pytest.mark.parametrize("name", ["tiny-flash", "tiny-standard"])
def test_quantize_covers_linears_experts_and_head(name):
    m = copy.deepcopy(preset(name).model)
    linears = [n for n, mod in m.named_modules() if isinstance(mod, torch.nn.Linear) and not isinstance(mod, Fp32Linear)]
    experts = [mod for mod in m.modules() if isinstance(mod, Experts)]
    n_experts = sum(mod.gate_up_proj.shape[0] for mod in experts)
    assert experts and "lm_head" in linears
    before = weight_bytes(m)
    report = quantize(m, "w8a8", plan=_plan("int8pack", "w8a8"))
    assert (report.linears, report.expert_layers, report.experts, report.head) == (
        len(linears), len(experts), n_experts, True)
    assert isinstance(m.lm_head, Int8Linear)
    assert not any(isinstance(mod, Experts) for mod in m.modules())
    assert sum(isinstance(mod, Int8Experts) for mod in m.modules()) == len(experts)
    left = [n for n, mod in m.named_modules() if type(mod) in (torch.nn.Linear, torch.nn.Embedding)]
    assert left == [] and report.embeddings == 1 and isinstance(m.model.embed_tokens if name == "tiny-standard"
                                                               else m.model.language_model.embed_tokens, Int8Embedding)
    assert report.bytes_before == before and report.bytes_after == weight_bytes(m) < before / 2
    assert f"{len(linears)} linears" in report.describe() and f"{n_experts} experts" in report.describe()


def test_tied_head_and_embedding_share_one_int8_table():
    from flashlane.config import parse_config
    from flashlane.models.llama import LlamaForCausalLM

    cfg = parse_config(dict(model_type="llama", vocab_size=300, hidden_size=32, intermediate_size=64,
                            num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                            tie_word_embeddings=True, eos_token_id=2))
    model = LlamaForCausalLM(cfg).eval()
    table = model.model.embed_tokens.weight.detach().clone()
    fp32 = sum(p.numel() * 4 for p in model.parameters()) + sum(b.numel() * b.element_size() for b in model.buffers())
    assert weight_bytes(model) == fp32                      # parameters() already yields the tied table once
    report = quantize(model, "int8", plan=_plan("int8pack"))
    emb = model.model.embed_tokens
    assert report.head and report.embeddings == 1 and isinstance(model.lm_head, Int8Linear)
    assert isinstance(emb, Int8Embedding) and emb.qweight is model.lm_head.qweight
    head_int8 = 300 * 32 + 300 * 4                          # int8 table + fp32 row scales, held once
    lin_before = sum(s * t * 4 for s, t in [(32, 32), (16, 32), (16, 32), (32, 32), (64, 32), (64, 32), (32, 64)])
    lin_after = sum(s * t + s * 4 for s, t in [(32, 32), (16, 32), (16, 32), (32, 32), (64, 32), (64, 32), (32, 64)])
    assert weight_bytes(model) == fp32 - 300 * 32 * 4 - lin_before + lin_after + head_int8
    ids = torch.tensor([[5, 299], [0, 5]])
    looked_up = emb(ids)                                    # the lookup: the dequantised rows
    assert looked_up.shape == (2, 2, 32) and looked_up.dtype == torch.float32
    assert torch.allclose(looked_up, dequantize_int8(*quantize_int8(table))[ids], rtol=0, atol=1e-7)
    assert (looked_up - table[ids]).abs().max() <= quantize_int8(table)[1].max() / 2 + 1e-6


# ---- the engine ---------------------------------------------------------------------------------

SMALL_CACHE = 16 * 2**20    # a few prompts need little; the default 512 MiB costs seconds to zero


def _with_model(base, model):
    return SimpleNamespace(**{**vars(base), "model": model})


def _llm(loaded, **kw) -> LLM:
    return LLM(loaded, dtype="float32", cache_memory=SMALL_CACHE, **kw)


def _prompts(base):
    return random_prompts(3, 16, 30, base.config.vocab_size, seed=3)


@functools.lru_cache(maxsize=None)
def _fp32_reference(name):
    base = preset(name)
    return _llm(base).generate(_prompts(base), TRACK_PARAMS)


def _dequantised_copy(model):
    """The float model whose weights are exactly what int8 holds: the int8 engine must match it."""
    out = copy.deepcopy(model)
    with torch.no_grad():
        for mod in out.modules():
            if isinstance(mod, Experts):
                params = [mod.gate_up_proj, mod.down_proj]
            elif isinstance(mod, torch.nn.Embedding) or (isinstance(mod, torch.nn.Linear)
                                                         and not isinstance(mod, Fp32Linear)):
                params = [mod.weight]
            else:
                continue
            for p in params:
                p.copy_(dequantize_int8(*quantize_int8(p)))
    return out


def _native_or_skip():
    from flashlane.kernels.native import row_gemm

    if row_gemm.unavailable():
        pytest.skip(f"native kernels: {row_gemm.unavailable()}")


@pytest.mark.parametrize("name", ["tiny-flash", "tiny-standard"])
@pytest.mark.parametrize("kernel", ["dequant-fp32", "native"])
def test_int8_engine_equals_fp32_engine_on_the_dequantised_weights(name, kernel):
    if kernel == "native":
        _native_or_skip()
    base = preset(name)
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True, prompt_logprobs=0)
    ref = _llm(_with_model(base, _dequantised_copy(base.model))).generate(_prompts(base), params)
    q = copy.deepcopy(base.model)
    quantize(q, "int8", plan=_plan(kernel))        # int8 storage, fp32 arithmetic
    out = _llm(_with_model(base, q)).generate(_prompts(base), params)
    assert [o.token_ids for o in out] == [r.token_ids for r in ref]
    diffs = [abs(list(a.values())[0] - list(b.values())[0])
             for o, r in zip(out, ref) for a, b in zip(o.prompt_logprobs[1:], r.prompt_logprobs[1:])]
    assert max(diffs) < 1e-4


@pytest.mark.parametrize("name", ["tiny-flash", "tiny-standard"])
@pytest.mark.parametrize("method", ["int8", "w8a8"])
def test_int8_engine_tracks_fp32(name, method, monkeypatch):
    """Random-weight tiny models have near-flat next-token distributions, so top-1 agreement is
    noise; the bound is on the prompt tokens' logprobs (measured mean 0.04-0.15 nats)."""
    monkeypatch.setenv(KERNEL_ENV, "w8a8" if method == "w8a8" else "int8pack")
    base = preset(name)
    ref = _fp32_reference(name)
    llm = _llm(_with_model(base, copy.deepcopy(base.model)), quantization=method)
    report = llm.engine.startup["quantization"]
    assert report["method"] == method and report["head"] and report["experts"] > 0
    assert report["kernels"] == dict.fromkeys(("decode", "batch", "prefill"), os.environ[KERNEL_ENV])
    assert f"quantization {method}" in llm.engine.describe_weights()
    out = llm.generate(_prompts(base), TRACK_PARAMS)
    diffs = [abs(list(a.values())[0] - list(b.values())[0])
             for o, r in zip(out, ref) for a, b in zip(o.prompt_logprobs[1:], r.prompt_logprobs[1:])]
    assert sum(diffs) / len(diffs) < 0.3 and max(diffs) < 1.5


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-flash", "tiny-standard", "hidden-glm5_next"])
def test_native_w8a8_engine_equals_torch_w8a8_batched_and_alone(name, monkeypatch):
    """The AVX2 W8A8 kernel sums exactly as torch._int_mm does: the same logprobs, not close ones.
    It is batch-invariant too: on llama, whose decode kernels are all batch-invariant, each prompt
    alone gives what it gave in the batch (the GLM models' torch kernels are not, and int8
    activation rounding turns their last-bit differences into visible ones)."""
    _native_or_skip()
    from flashlane.kernels.backends.cpu.backend import CpuBackend

    # the linears one at a time (a whole native llama layer rounds softmax and SiLU its own way)
    monkeypatch.setattr(CpuBackend, "dense_decoder_layer", lambda self, *a, **k: None)
    base = {"tiny-llama": tiny_llama, "hidden-glm5_next": lambda: small_glm("glm5_next", seed=5, hc_mult=3,
                                                                           index_kpool=2)}.get(name, lambda: preset(name))()
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logprobs=0)
    outs = {}
    for kernel in ("w8a8", "w8a8-native"):
        q = copy.deepcopy(base.model)
        quantize(q, "w8a8", plan=_plan(kernel, "w8a8"))
        llm = _llm(_with_model(base, q))
        outs[kernel] = llm.generate(_prompts(base), params)
        if kernel == "w8a8-native" and name == "tiny-llama":
            # a fresh engine without prefix caching: a hit would attend its suffix after cached
            # history (two flash calls merged), which rounds differently from one call from 0
            fresh = _llm(_with_model(base, q), enable_prefix_caching=False)
            alone = [fresh.generate([p], params)[0] for p in _prompts(base)]
            assert [o.token_ids for o in alone] == [o.token_ids for o in outs[kernel]]
            assert [o.logprobs for o in alone] == [o.logprobs for o in outs[kernel]]
    for a, b in zip(outs["w8a8-native"], outs["w8a8"]):
        assert a.token_ids == b.token_ids and a.logprobs == b.logprobs


def test_engine_reports_weight_bytes_and_rejects_unknown_quantization():
    base = tiny_llama()
    llm = _llm(_with_model(base, copy.deepcopy(base.model)), quantization="int8")
    s = llm.engine.startup
    assert s["quantization"]["linears"] == 15 and s["quantization"]["expert_layers"] == 0
    assert s["weight_bytes"] == s["quantization"]["bytes_after"] < s["quantization"]["bytes_before"]
    assert "15 linears (head int8)" in llm.engine.describe_weights() and s["quantization"]["embeddings"] == 1
    assert _llm(base).engine.startup["quantization"] is None
    with pytest.raises(ValueError, match="quantization"):
        _llm(base, quantization="int4")


def test_cli_quantization_flag():
    import argparse

    from flashlane.cli.engine_flags import add_engine_flags, engine_kwargs

    p = argparse.ArgumentParser(prog="flashlane serve")
    add_engine_flags(p)
    p.add_argument("model")
    assert engine_kwargs(p.parse_args(["m", "--quantization", "w8a8"]))["quantization"] == "w8a8"
    with pytest.raises(SystemExit) as exc:
        p.parse_args(["m", "--quantization", "int4"])
    assert exc.value.code == 2


@pytest.mark.slow
def test_smollm2_int8_and_w8a8_still_answer_paris():
    from flashlane import presets

    try:
        presets.smollm2_gguf_path()
    except presets.PresetError as exc:
        pytest.skip(str(exc))
    loaded = preset("smollm2-135m")                  # loaded once for every test module that asks
    tok = loaded.tokenizer
    chat = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}])
    prompt = tok.encode(chat, add_special_tokens=False)
    params = SamplingParams(max_tokens=16, temperature=0)
    # int8 with the kernel conftest pins (the packed one); w8a8 forced on every row count
    for method, plan in (("int8", None), ("w8a8", _plan("w8a8", "w8a8"))):
        model = copy.deepcopy(loaded.model)
        quantize(model, method, plan=plan)
        out = _llm(_with_model(loaded, model)).generate([prompt], params)[0]
        assert "Paris" in out.text, (method, out.text)


# ---- choices per CPU capability (injected machines) ------------------------------------------

def test_caps_flags():
    assert not AVX2.int8_dot and not AVX2.native_bf16
    assert AVX512_VNNI.int8_dot and not AVX512_VNNI.native_bf16
    assert AMX.int8_dot and AMX.native_bf16
    assert CpuCaps("AMX").int8_dot and CpuCaps("AMX").native_bf16


def test_kernel_candidates_follow_capability():
    assert candidates("int8", AVX2, native=False) == ("int8pack", "dequant-fp32")
    assert candidates("w8a8", AVX2, native=False) == ("int8pack", "dequant-fp32")         # no VNNI: no W8A8
    assert candidates("w8a8", AVX512_VNNI, native=False) == ("int8pack", "dequant-fp32", "w8a8")
    assert candidates("w8a8", AMX, native=False) == ("int8pack", "dequant-bf16", "w8a8")
    assert candidates("int8", AVX2, native=True) == ("int8pack", "dequant-fp32", "native")
    assert candidates("w8a8", AVX2, native=True) == ("int8pack", "dequant-fp32", "native", "w8a8-native")
    assert candidates("w8a8", AMX, native=True) == ("int8pack", "dequant-bf16", "native", "w8a8", "w8a8-native")
    with pytest.raises(ValueError, match="quantization"):
        candidates("int4", AMX)


def test_native_candidate_needs_avx2_and_fma():
    from flashlane.kernels.native import row_gemm

    assert "native" not in candidates("int8", CpuCaps("DEFAULT", frozenset({"sse4_2"})))
    assert "native" not in candidates("int8", CpuCaps("AVX2", frozenset({"avx2"})))        # no FMA
    assert ("native" in candidates("int8", AVX2)) == (row_gemm.unavailable() is None)


def test_native_int8_kernel_matches_the_dequantised_reference():
    from flashlane.kernels.native import row_gemm

    if row_gemm.unavailable():
        pytest.skip(f"native kernels: {row_gemm.unavailable()}")
    g = torch.Generator().manual_seed(3)
    for n, k in ((37, 19), (64, 576), (5, 8), (3, 1)):
        q, scale = quantize_int8(torch.randn(n, k, generator=g))
        bias = torch.randn(n, generator=g)
        for rows in (1, 2, 3, 8, 16, 17, 40):
            x = torch.randn(rows, k, generator=g)
            w = dequantize_int8(q, scale).double()
            bound = 1e-5 * (x.double().abs() @ w.abs().t()) + 1e-6     # fp32 rounding of the dot
            for b in (None, bias):
                exact = x.double() @ w.t() + (0 if b is None else b.double())
                got = KERNELS["native"](x, q, scale, b)
                assert ((got.double() - exact).abs() <= bound).all(), (n, k, rows)
        # batch-invariant up to MAX_ROWS: a row alone equals the same row in any batch
        x = torch.randn(row_gemm.MAX_ROWS, k, generator=g)
        full = KERNELS["native"](x, q, scale)
        assert all(torch.equal(full[i:i + 1], KERNELS["native"](x[i:i + 1], q, scale)) for i in range(len(x)))
    # strided and 3-D activations; bf16 activations take the dequantising path
    x = torch.randn(2, 3, 2 * 576, generator=g)[..., ::2]
    q, scale = quantize_int8(torch.randn(64, 576, generator=g))
    assert torch.allclose(KERNELS["native"](x, q, scale), int8_linear_reference(x, q, scale), atol=1e-4)
    xb = torch.randn(2, 576, generator=g).bfloat16()
    assert KERNELS["native"](xb, q, scale).dtype == torch.bfloat16


def test_native_w8a8_kernel_equals_torch_w8a8_bit_for_bit():
    from flashlane.kernels.native import row_gemm

    if row_gemm.unavailable():
        pytest.skip(f"native kernels: {row_gemm.unavailable()}")
    g = torch.Generator().manual_seed(4)
    # K tails below and above the 32-byte step, rows above MAX_ROWS (torch's path), a zero row
    for n, k in ((37, 19), (64, 576), (9, 64), (7, 33), (3, 2), (576, 1536)):
        q, scale = quantize_int8(torch.randn(n, k, generator=g))
        bias = torch.randn(n, generator=g)
        for rows in (1, 2, 3, 8, 16, 17):
            x = torch.randn(rows, k, generator=g) * 3
            x[0] = 0 if rows > 2 else x[0]
            for b in (None, bias):
                assert torch.equal(KERNELS["w8a8-native"](x, q, scale, b), KERNELS["w8a8"](x, q, scale, b)), (n, k, rows)


def test_plan_offers_native_only_for_float32_activations():
    seen = []
    timer = lambda kernel, rows, shape, dtype: seen.append((kernel, dtype)) or 1e-6   # noqa: E731
    choose_plan("int8", AVX2, (64, 32), timer=timer, native=True)
    assert ("native", torch.float32) in seen
    seen.clear()
    choose_plan("int8", AVX2, (64, 32), timer=timer, dtype=torch.bfloat16, native=True)
    assert all(k != "native" for k, _ in seen)


def test_plan_picks_the_fastest_kernel_per_row_class_and_says_why():
    # packed int8 grows with rows, W8A8 has a fixed cost: the crossover lands in the batch class
    cost = {"int8pack": lambda r: 1.0 + r, "dequant-fp32": lambda r: 50.0 + r / 8, "w8a8": lambda r: 10.0 + r / 16}
    timer = lambda kernel, rows, shape, dtype: cost[kernel](rows) * 1e-6   # noqa: E731
    plan = choose_plan("w8a8", AVX512_VNNI, (64, 32), timer=timer)
    assert plan.by_class() == {"decode": "int8pack", "batch": "w8a8", "prefill": "w8a8"}
    assert [plan.kernel_for(r) for r in (1, 7, 8, 63, 64, 4096)] == ["int8pack"] * 2 + ["w8a8"] * 4
    assert "timed on 64x32" in plan.why and "w8a8 0.01ms" in plan.why
    slow_w8a8 = choose_plan("w8a8", AVX2, (64, 32), timer=timer, native=False)   # same timings, no VNNI
    assert "w8a8" not in slow_w8a8.kernels and "falls back to weight-only" in slow_w8a8.why
    assert choose_plan("int8", AVX2, (64, 32), timer=timer, native=False).by_class()["prefill"] == "dequant-fp32"
    # flashlane's AVX2 W8A8 kernel needs no VNNI: W8A8 is kept, not replaced by weight-only int8
    cost.update({"native": lambda r: 2.0 + r, "w8a8-native": lambda r: 0.5 + r / 4})
    avx2_w8a8 = choose_plan("w8a8", AVX2, (64, 32), timer=timer, native=True)
    assert avx2_w8a8.by_class()["decode"] == "w8a8-native" and "falls back" not in avx2_w8a8.why
    gpu = choose_plan("int8", AMX, (64, 32), device="meta", timer=None)
    assert gpu.kernels == ("int8pack",) * 3


def test_auto_dtype_needs_native_bf16_and_a_clear_win():
    def never(dtype, rows):
        raise AssertionError("no timing without native bf16")

    assert choose_cpu_dtype(AVX512_VNNI, never).dtype == "float32"
    bf16_wins = lambda dtype, rows: (0.5 if dtype == torch.bfloat16 else 1.0) * rows   # noqa: E731
    choice = choose_cpu_dtype(AMX, bf16_wins)
    assert choice.dtype == "bfloat16" and "bf16 no slower at 1 row, >=10% faster at 64 rows" in choice.why
    # faster at prefill, but not 2x, and slower at decode: float32
    only_prefill = lambda dtype, rows: ((0.6 if rows > 1 else 1.1) if dtype == torch.bfloat16 else 1.0)   # noqa: E731
    assert choose_cpu_dtype(AMX, only_prefill).dtype == "float32"
    marginal = lambda dtype, rows: 0.97 if dtype == torch.bfloat16 else 1.0   # noqa: E731
    assert choose_cpu_dtype(AMX, marginal).dtype == "float32"


def test_timed_choice_unless_pinned(monkeypatch):
    m = copy.deepcopy(tiny_llama().model)
    monkeypatch.delenv(KERNEL_ENV, raising=False)
    timed = quantize(m, "int8", caps=AVX2).plan           # timed on this machine, AVX2 candidates
    assert set(timed.kernels) <= {"int8pack", "dequant-fp32", "native"} and "timed on 128x64" in timed.why
    monkeypatch.setenv(KERNEL_ENV, "int4")
    with pytest.raises(ValueError, match=KERNEL_ENV):
        quantize(copy.deepcopy(tiny_llama().model), "int8")


def test_auto_dtype_pin(monkeypatch):
    from flashlane.models.loader import LoadError, resolve_dtype

    monkeypatch.setenv("FLASHLANE_AUTO_DTYPE", "bfloat16")
    assert resolve_dtype("auto", None, "cpu") == torch.bfloat16
    assert resolve_dtype("float32", None, "cpu") == torch.float32
    monkeypatch.setenv("FLASHLANE_AUTO_DTYPE", "int8")
    with pytest.raises(LoadError, match="FLASHLANE_AUTO_DTYPE"):
        resolve_dtype("auto", None, "cpu")


@pytest.mark.parametrize("tokens", [3, 40])   # 3 x 2 choices < 8 experts: gathered; 40: all experts
def test_fixed_shape_experts_match_the_dispatching_kernels(tokens):
    """The compiled step's expert path (no per-expert host sync) against the eager dispatch."""
    x, weights, ids, gate_up, down = _experts(e=8, n=tokens)
    ref = grouped_experts(x, weights, ids, gate_up, down, swiglu_limit=7.0)
    assert _rel(experts_fixed_shape(x, weights, ids, gate_up, down, 7.0), ref) < 1e-5
    (gq, gs), (dq, ds) = quantize_int8(gate_up), quantize_int8(down)
    int8_ref = grouped_experts_int8(x, weights, ids, gq, gs, dq, ds, 7.0, linear=int8_linear_reference)
    assert _rel(experts_fixed_shape(x, weights, ids, gq, dq, 7.0, gs, ds), int8_ref) < 2e-2
