"""flashlane's llama against transformers' LlamaForCausalLM on a tiny random config (fp32)."""

import pytest
import torch
import transformers
from paged_runner import PagedRunner

from flashlane.config import parse_config
from flashlane.kernels.native import prefill_attention_f32
from flashlane.models.llama import LlamaForCausalLM

LENGTHS = (37, 90, 5)


def _hf_llama(tie: bool, rope_parameters=None, seed: int = 0, **sizes):
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(**{
        "vocab_size": 300, "hidden_size": 64, "intermediate_size": 160, "num_hidden_layers": 3,
        "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 512,
        "rope_parameters": rope_parameters or {"rope_type": "default", "rope_theta": 10000.0},
        "tie_word_embeddings": tie, "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0, **sizes,
    })
    cfg._attn_implementation = "eager"
    model = transformers.LlamaForCausalLM(cfg).eval()
    with torch.no_grad():  # HF's init is too small to make the logits interesting
        for name, p in model.named_parameters():
            if p.dim() == 2:
                p.normal_(0, 0.1)
            elif "norm" in name:
                p.uniform_(0.5, 1.5)
    return model


def _ours(hf):
    cfg = parse_config(hf.config.to_dict())
    model = LlamaForCausalLM(cfg).eval()
    model.load_state_dict(hf.state_dict(), strict=True)
    model.post_load()
    return model, cfg


def _prompts(vocab: int, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in LENGTHS]


def _hf_logprobs(hf, prompt):
    with torch.no_grad():
        return torch.log_softmax(hf(torch.tensor([prompt])).logits[0].float(), -1)


@pytest.fixture(scope="module", params=[False, True], ids=["untied", "tied"])
def pair(request):
    hf = _hf_llama(tie=request.param)
    model, cfg = _ours(hf)
    return hf, model, cfg


def test_state_dict_names_match_transformers(pair):
    hf, model, _ = pair
    assert set(model.state_dict()) == set(hf.state_dict())


@pytest.mark.parametrize("chunk", [None, 16, 7])
def test_prompt_logprobs_batched_and_chunked(pair, chunk):
    hf, model, cfg = pair
    prompts = _prompts(cfg.vocab_size)
    ours = PagedRunner(model, cfg, page_size=16).prefill(prompts, chunk=chunk)
    for p, lp in zip(prompts, ours):
        ref = _hf_logprobs(hf, p)
        assert lp.shape == ref.shape
        assert (lp - ref).abs().max().item() <= 1e-4


def test_greedy_decode_matches_generate(pair):
    hf, model, cfg = pair
    prompts = _prompts(cfg.vocab_size, seed=2)
    steps = 24
    ours = PagedRunner(model, cfg, page_size=8).greedy(prompts, steps, chunk=32)
    for p, toks in zip(prompts, ours):
        with torch.no_grad():
            ref = hf.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                              max_new_tokens=steps, min_new_tokens=steps, do_sample=False,
                              pad_token_id=0)
        assert toks == ref[0, len(p):].tolist()


def test_decode_and_prefill_in_one_batch(pair):
    hf, model, cfg = pair
    first, second = _prompts(cfg.vocab_size, seed=3)[:2]
    gen, lp_second = PagedRunner(model, cfg, page_size=16).mixed(first, second, decode_steps=6)
    with torch.no_grad():
        ref = hf.generate(torch.tensor([first]), max_new_tokens=len(gen), min_new_tokens=len(gen),
                          do_sample=False, pad_token_id=0)
    assert gen == ref[0, len(first):].tolist()
    assert (lp_second - _hf_logprobs(hf, second)).abs().max().item() <= 1e-4


def test_llama3_rope_scaling():
    rope = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
    hf = _hf_llama(tie=True, rope_parameters=rope, seed=5)
    model, cfg = _ours(hf)
    assert cfg.rope_scaling is not None
    prompts = _prompts(cfg.vocab_size, seed=4)
    for p, lp in zip(prompts, PagedRunner(model, cfg).prefill(prompts, chunk=32)):
        assert (lp - _hf_logprobs(hf, p)).abs().max().item() <= 1e-4


def test_bfloat16_close_to_float32(pair):
    _, model, cfg = pair
    prompts = _prompts(cfg.vocab_size)
    ref = PagedRunner(model, cfg).prefill(prompts)
    low = LlamaForCausalLM(cfg).eval()
    low.load_state_dict(model.state_dict())
    low.post_load()
    low.to(torch.bfloat16)
    got = PagedRunner(low, cfg, dtype=torch.bfloat16).prefill(prompts, chunk=16)
    for a, b in zip(got, ref):
        assert (a.exp() - b.exp()).abs().max().item() < 0.05


def test_rejects_non_llama_config():
    cfg = parse_config({"model_type": "glm_moe_dsa", "vocab_size": 64, "hidden_size": 32,
                        "num_hidden_layers": 1, "intermediate_size": 64, "num_attention_heads": 2,
                        "q_lora_rank": 8, "kv_lora_rank": 8, "qk_nope_head_dim": 8,
                        "qk_rope_head_dim": 4, "v_head_dim": 8, "index_n_heads": 2,
                        "index_head_dim": 8, "index_topk": 4, "moe_intermediate_size": 16,
                        "n_routed_experts": 4, "num_experts_per_tok": 2})
    with pytest.raises(ValueError, match="llama"):
        LlamaForCausalLM(cfg)


def test_qwen2_style_biases_match_transformers():
    torch.manual_seed(7)
    cfg = transformers.Qwen2Config(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                                   tie_word_embeddings=False, use_sliding_window=False)
    cfg._attn_implementation = "eager"
    hf = transformers.Qwen2ForCausalLM(cfg).eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.normal_(0, 0.1)
    model, ours_cfg = _ours(hf)
    assert model.model.layers[0].self_attn.q_proj.bias is not None
    assert model.model.layers[0].self_attn.o_proj.bias is None
    prompts = _prompts(ours_cfg.vocab_size)
    for p, lp in zip(prompts, PagedRunner(model, ours_cfg).prefill(prompts, chunk=16)):
        assert (lp - _hf_logprobs(hf, p)).abs().max().item() <= 1e-4


def test_unsupported_llama_variants_are_named():
    base = dict(model_type="llama", vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                num_attention_heads=2)
    with pytest.raises(ValueError, match="mlp_bias"):
        LlamaForCausalLM(parse_config({**base, "mlp_bias": True}))
    with pytest.raises(ValueError, match="sliding_window"):
        LlamaForCausalLM(parse_config({**base, "model_type": "mistral", "sliding_window": 16}))


@pytest.mark.skipif(not prefill_attention_f32.preferred(),
                    reason=f"the float32 prefill attention cannot run here: {prefill_attention_f32.unavailable()}")
@pytest.mark.parametrize("chunk", [None, 64, 29])
def test_head_dim_64_prefill_through_the_native_kernel(chunk, monkeypatch):
    """Head dim 64 (three query heads on one kv head), which the cpu backend's float32 prefill
    attention takes (``kernels/native/prefill_attention_f32``): prompts whole and in chunks after
    cached history, batched; every prompt token's log-probs within 1e-4 of transformers', and the
    kernel ran (after history where chunked)."""
    hf = _hf_llama(tie=False, hidden_size=192, intermediate_size=256, num_hidden_layers=2, num_attention_heads=3,
                   num_key_value_heads=1, max_position_embeddings=1024)
    model, cfg = _ours(hf)
    starts = []
    real = prefill_attention_f32.prefill_attention
    monkeypatch.setattr(prefill_attention_f32, "prefill_attention",
                        lambda *a, **k: starts.append(a[3]) or real(*a, **k))
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 300, (n,), generator=g).tolist() for n in (300, 61, 140)]
    ours = PagedRunner(model, cfg, page_size=16).prefill(prompts, chunk=chunk)
    assert starts and (max(starts) > 0) == (chunk is not None)
    for p, lp in zip(prompts, ours):
        assert (lp - _hf_logprobs(hf, p)).abs().max().item() <= 1e-4
