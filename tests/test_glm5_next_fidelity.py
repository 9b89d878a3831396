"""flashlane's glm5_next against transformers' Glm5NextForConditionalGeneration (tiny, fp32).

The reference is the spec §4.1 tiny model (KDA + DSA layers, a full and a shared indexer,
kpool 4 with index_topk 8 so every context here is sparse and hits the tail rule, dense and MoE
FFNs, 4 mHC streams) with tie-free indexers and randomised constant inits (§4.3). Its
language-model state_dict loads into flashlane strictly by name; everything runs through the
paged cache exactly as the engine drives it.
"""

import pytest
import torch
from hf_tiny import glm5_next_text_state_dict, make_hf_glm5_next
from paged_runner import PagedRunner

from flashlane.config import parse_config
from flashlane.kernels.backends.cpu.backend import CpuBackend
from flashlane.models.glm5_next import Glm5NextForCausalLM
from flashlane.models.loader import cast_model

LENGTHS = (23, 97, 300)
NEW_TOKENS = 32
TOL = 1e-4


@pytest.fixture(scope="module")
def pair():
    hf = make_hf_glm5_next(seed=0)
    cfg = parse_config(hf.config.to_dict())
    ours = Glm5NextForCausalLM(cfg, with_mtp=False).eval()
    ours.load_state_dict(glm5_next_text_state_dict(hf), strict=True)
    ours.post_load()
    return hf, ours, cfg


@pytest.fixture(scope="module")
def prompts(pair):
    vocab = pair[2].vocab_size
    gen = torch.Generator().manual_seed(1)
    return [torch.randint(1, vocab, (n,), generator=gen).tolist() for n in LENGTHS]


def _hf_logprobs(hf, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return torch.log_softmax(hf(input_ids=torch.tensor([ids])).logits[0].float(), -1)


@pytest.fixture(scope="module")
def hf_prompt_logprobs(pair, prompts):
    return [_hf_logprobs(pair[0], p) for p in prompts]


@pytest.fixture(scope="module")
def hf_greedy(pair, prompts):
    """transformers' own cached greedy generation, one prompt at a time (no padding)."""
    out = []
    with torch.no_grad():
        for p in prompts:
            ids = torch.tensor([p])
            seq = pair[0].generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS,
                                   do_sample=False)
            out.append(seq[0, len(p):].tolist())
    return out


def _runner(pair, seed=0):
    _, ours, cfg = pair
    return PagedRunner(ours, cfg, page_size=16, max_tokens=512, max_seqs=4, seed=seed)


def _max_err(got, want):
    return max((g - w).abs().max().item() for g, w in zip(got, want))


def test_parameter_names_and_shapes_equal_the_reference(pair):
    hf, ours, cfg = pair
    want = {k: tuple(v.shape) for k, v in glm5_next_text_state_dict(hf).items()}
    got = {k: tuple(v.shape) for k, v in ours.state_dict().items()}
    assert got == want


def test_mtp_block_weights_exist_under_the_next_layer_index(pair):
    _, _, cfg = pair
    with_mtp = Glm5NextForCausalLM(cfg)
    extra = set(with_mtp.state_dict()) - set(pair[1].state_dict())
    prefix = f"model.language_model.layers.{cfg.num_layers}."
    assert extra and all(k.startswith(prefix) for k in extra)
    for leaf in ("enorm.weight", "hnorm.weight", "eh_proj.weight", "shared_head.norm.weight",
                 "input_layernorm.weight", "post_attention_layernorm.weight",
                 "self_attn.kv_b_proj.weight", "self_attn.indexer.wq_b.weight",
                 "self_attn.indexer.index_kpool_compress_gate", "mlp.gate.weight", "mlp.experts.gate_up_proj",
                 "mlp.shared_experts.down_proj.weight"):
        assert prefix + leaf in extra, leaf
    assert with_mtp.state_dict()[prefix + "eh_proj.weight"].shape == (cfg.hidden_size, 2 * cfg.hidden_size)
    assert Glm5NextForCausalLM.checkpoint_has_mtp(cfg, extra)
    assert not Glm5NextForCausalLM.checkpoint_has_mtp(cfg, pair[1].state_dict())


@pytest.mark.parametrize("chunk", [None, 64, 29])
def test_prompt_logprobs_match_reference_in_one_batch(pair, prompts, hf_prompt_logprobs, chunk):
    """All prompts advance together per call; chunk=None is one call for everything."""
    got = _runner(pair).prefill(prompts, chunk)
    assert [g.shape for g in got] == [w.shape for w in hf_prompt_logprobs]
    assert _max_err(got, hf_prompt_logprobs) <= TOL


def test_decode_steps_match_reference_full_forward(pair, prompts):
    """Teacher-forced batched decode after a batched prefill: every step's log-probs equal the
    reference's full (uncached) forward over prompt + fed tokens."""
    runner = _runner(pair, seed=3)
    runner.prefill(prompts)
    steps = 12
    gen = torch.Generator().manual_seed(5)
    fed = [torch.randint(1, pair[2].vocab_size, (steps,), generator=gen).tolist() for _ in prompts]
    got = [[] for _ in prompts]
    for i in range(steps):
        logits = runner._step(list(range(len(prompts))), [[f[i]] for f in fed], [len(p) + i for p in prompts])
        for s in range(len(prompts)):
            got[s].append(torch.log_softmax(logits[s], -1))
    for s, p in enumerate(prompts):
        want = _hf_logprobs(pair[0], p + fed[s])[len(p):]
        assert (torch.stack(got[s]) - want).abs().max().item() <= TOL


@pytest.mark.slow
def test_greedy_batched_matches_reference_generate(pair, prompts, hf_greedy):
    assert _runner(pair).greedy(prompts, NEW_TOKENS) == hf_greedy


@pytest.mark.slow
def test_greedy_with_chunked_prefill_matches_reference_generate(pair, prompts, hf_greedy):
    assert _runner(pair, seed=1).greedy(prompts, NEW_TOKENS, chunk=64) == hf_greedy


@pytest.mark.slow
def test_greedy_each_prompt_alone_matches_reference_generate(pair, prompts, hf_greedy):
    for p, want in zip(prompts, hf_greedy):
        assert _runner(pair, seed=2).greedy([p], NEW_TOKENS) == [want]


def test_decode_and_prefill_mixed_in_one_call(pair, prompts, hf_prompt_logprobs):
    """Sequence 0 decodes while sequence 1 prefills in pieces in the same forward calls; the
    greedy tokens are the reference's argmax over its full forward of prompt + tokens."""
    gen, lp = _runner(pair, seed=4).mixed(prompts[0], prompts[2], decode_steps=6)
    want = _hf_logprobs(pair[0], prompts[0] + gen[:-1])[len(prompts[0]) - 1:]
    assert want.argmax(-1).tolist() == gen
    assert (lp - hf_prompt_logprobs[2]).abs().max().item() <= TOL


def test_bfloat16_cache_and_weights_run_close_to_fp32(pair, prompts):
    _, ours, cfg = pair
    half = Glm5NextForCausalLM(cfg, with_mtp=False).eval()
    half.load_state_dict(ours.state_dict())
    cast_model(half, torch.bfloat16)
    kept = {n for n, p in half.named_parameters() if p.dtype == torch.float32}
    assert any(n.endswith("conv1d.weight") for n in kept) and any(n.endswith("attn_hc.fn") for n in kept)
    assert half.lm_head.weight.dtype == torch.bfloat16
    short = [p[:40] for p in prompts]
    lp16 = PagedRunner(half, cfg, page_size=16, max_tokens=128, max_seqs=4, dtype=torch.bfloat16).prefill(short)
    lp32 = _runner(pair).prefill(short)
    for a, b in zip(lp16, lp32):
        assert torch.isfinite(a).all()
        # early positions only: later, sparse-selection and routing flips compound
        assert (a[:8] - b[:8]).abs().max().item() < 0.15


def test_bfloat16_native_kernels_run_close_to_the_torch_kernels(pair, prompts):
    """Where the CPU has native bf16 the engine picks bf16, and the native KDA, short-conv and mHC
    kernels take it (float32 arithmetic, bf16 in and out): the same model through the torch-only
    backend must land within bf16 noise."""
    if CpuBackend().describe() == CpuBackend(native=False).describe():
        pytest.skip("no native kernels on this CPU")
    _, ours, cfg = pair
    half = Glm5NextForCausalLM(cfg, with_mtp=False).eval()
    half.load_state_dict(ours.state_dict())
    cast_model(half, torch.bfloat16)
    short = [p[:40] for p in prompts]
    runs = [PagedRunner(half, cfg, page_size=16, max_tokens=128, max_seqs=4, dtype=torch.bfloat16,
                        ops=CpuBackend(native=native)).prefill(short) for native in (True, False)]
    for a, b in zip(*runs):
        assert torch.isfinite(a).all()
        assert (a[:16] - b[:16]).abs().max().item() < 0.05


def test_rejects_a_config_of_another_architecture():
    cfg = parse_config(dict(model_type="llama", vocab_size=64, hidden_size=16, intermediate_size=32,
                            num_hidden_layers=1, num_attention_heads=2))
    with pytest.raises(ValueError, match="arch"):
        Glm5NextForCausalLM(cfg)
