"""Weight-only int8: the kernel against a dequantised matmul, and whole models against fp32."""

import pytest
import torch

from flashlane import LLM, SamplingParams
from flashlane.kernels.quant_matmul import int8_linear, quantize_int8
from flashlane.models.quantize import Int8Linear, quantize_model

from engine_models import random_prompts, tiny_llama


def test_int8_linear_equals_dequantised_matmul():
    torch.manual_seed(0)
    w, x, b = torch.randn(48, 64), torch.randn(5, 64), torch.randn(48)
    q, scale = quantize_int8(w)
    assert q.dtype == torch.int8 and (q.abs() <= 127).all()
    deq = q.float() * scale[:, None]
    assert (deq - w).abs().max() <= scale.max() / 2 + 1e-6       # round-to-nearest per row
    ref = x.bfloat16().float() @ deq.t() + b
    out = int8_linear(x, q, scale, b)
    assert out.dtype == x.dtype and out.shape == (5, 48)
    assert torch.allclose(out, ref, rtol=2e-2, atol=2e-2)


def test_quantize_model_swaps_linears_and_rejects_unknown_methods():
    m = tiny_llama(seed=7).model
    import copy
    m = copy.deepcopy(m)
    n = quantize_model(m, "int8")
    assert n == 2 * 7 + 1 and isinstance(m.model.layers[0].self_attn.q_proj, Int8Linear)
    assert isinstance(m.lm_head, Int8Linear)          # the head too: for SmolLM2 it is 21% of the bytes
    assert m.model.embed_tokens.weight.dtype == torch.float32
    with pytest.raises(ValueError, match="quantization"):
        quantize_model(m, "int3")


def test_int8_engine_keeps_batch_invariance_and_tracks_fp32():
    import copy
    from types import SimpleNamespace

    base = tiny_llama()
    q = SimpleNamespace(**{**vars(base), "model": copy.deepcopy(base.model)})
    prompts = random_prompts(8, 5, 120, 256, seed=9)
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, prompt_logprobs=0)
    llm = LLM(q, dtype="float32", quantization="int8")
    together = llm.generate(prompts, params)
    alone = [llm.generate([p], params)[0] for p in prompts]
    assert [o.token_ids for o in together] == [o.token_ids for o in alone]
    ref = LLM(base, dtype="float32").generate(prompts, params)
    diffs = [abs(list(a.values())[0] - list(b.values())[0])
             for o, r in zip(together, ref) for a, b in zip(o.prompt_logprobs[1:], r.prompt_logprobs[1:])]
    assert max(diffs) < 0.25 and sum(diffs) / len(diffs) < 0.05


@pytest.mark.slow
def test_int8_smollm2_stays_close_to_fp32():
    from flashlane.models.registry import load_model

    prompt = "The capital of France is Paris. The capital of Germany is"
    params = SamplingParams(max_tokens=8, temperature=0, prompt_logprobs=0)
    ref = LLM(load_model("smollm2-135m", dtype="float32"), dtype="float32").generate(prompt, params)[0]
    out = LLM(load_model("smollm2-135m", dtype="float32"), dtype="float32", quantization="int8").generate(
        prompt, params)[0]
    diffs = [abs(list(a.values())[0] - list(b.values())[0])
             for a, b in zip(out.prompt_logprobs[1:], ref.prompt_logprobs[1:])]
    assert sum(diffs) / len(diffs) < 0.1
    assert "Berlin" in out.text and "Berlin" in ref.text
