"""glm_moe_dsa end to end against transformers (spec §4.2): a tiny seeded reference with full and
shared indexer layers and ``index_topk`` (8) far below the context, loaded by name, run through
the paged cache in mixed multi-sequence batches."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch

from flashlane.config import parse_config
from flashlane.models.glm_moe_dsa import GlmMoeDsaForCausalLM

from hf_tiny import make_hf_glm_moe_dsa
from paged_runner import PagedRunner

PROMPT_LENS = (20, 131, 300)
GREEDY_STEPS = 32
TOL = 1e-4


@pytest.fixture(scope="module")
def ref():
    torch.manual_seed(0)
    hf = make_hf_glm_moe_dsa(seed=0)
    hf.generation_config.eos_token_id = None     # always 32 tokens, never an early stop
    cfg = parse_config(hf.config.to_dict())
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, cfg.vocab_size, (n,), generator=gen).tolist() for n in PROMPT_LENS]
    with torch.no_grad():
        logprobs = [torch.log_softmax(hf(torch.tensor([p])).logits[0].float(), -1) for p in prompts]
        greedy = [hf.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                              max_new_tokens=GREEDY_STEPS, do_sample=False, pad_token_id=0)[0, len(p):].tolist()
                  for p in prompts]
    return dict(hf=hf, cfg=cfg, prompts=prompts, logprobs=logprobs, greedy=greedy)


def build(ref, **cfg_changes) -> GlmMoeDsaForCausalLM:
    cfg = dataclasses.replace(ref["cfg"], **cfg_changes)
    model = GlmMoeDsaForCausalLM(cfg, with_mtp=False).eval()
    model.load_state_dict(ref["hf"].state_dict(), strict=True)
    return model


def runner(model, **kw) -> PagedRunner:
    return PagedRunner(model, model.config, page_size=16, max_tokens=400, max_seqs=4, **kw)


def max_err(got, want) -> float:
    return max(float((g - w).abs().max()) for g, w in zip(got, want))


def test_config_is_sparse_with_full_and_shared_layers(ref):
    cfg = ref["cfg"]
    assert set(cfg.indexer_types) == {"full", "shared"}
    assert cfg.index_topk * 2 < min(PROMPT_LENS)
    assert set(cfg.ffn_types) == {"dense", "moe"}


def test_parameter_names_are_the_reference_state_dict(ref):
    model = GlmMoeDsaForCausalLM(ref["cfg"], with_mtp=False)
    assert set(model.state_dict()) == set(ref["hf"].state_dict())


def test_prompt_logprobs_in_one_batch(ref):
    lps = runner(build(ref)).prefill(ref["prompts"])
    assert max_err(lps, ref["logprobs"]) <= TOL


@pytest.mark.parametrize("chunk", [37, 64])
def test_prompt_logprobs_with_chunked_prefill(ref, chunk):
    lps = runner(build(ref), seed=chunk).prefill(ref["prompts"], chunk=chunk)
    assert max_err(lps, ref["logprobs"]) <= TOL


def test_prompt_logprobs_while_another_sequence_decodes(ref):
    first, second = ref["prompts"][0], ref["prompts"][2]
    gen, lp = runner(build(ref)).mixed(first, second, decode_steps=7)
    assert gen == ref["greedy"][0][: len(gen)]
    assert float((lp - ref["logprobs"][2]).abs().max()) <= TOL


def test_greedy_batched_matches_hf_generate(ref):
    assert runner(build(ref)).greedy(ref["prompts"], GREEDY_STEPS) == ref["greedy"]


@pytest.mark.slow
def test_greedy_alone_matches_hf_generate(ref):
    model = build(ref)
    for p, want in zip(ref["prompts"], ref["greedy"]):
        assert runner(model).greedy([p], GREEDY_STEPS, chunk=100) == [want]


def test_sparsity_changes_the_result(ref):
    """The reference agreement above is not an accident of dense attention."""
    dense = runner(build(ref, index_topk=512)).prefill(ref["prompts"][2:])
    assert max_err(dense, ref["logprobs"][2:]) > 1e-2


def test_bf16_drifts_no_more_than_the_reference_in_bf16(ref):
    """bf16 drift from the fp32 reference is that of transformers' own bf16 run, not more."""
    prompts, want = ref["prompts"][:2], ref["logprobs"][:2]
    hf_bf16 = copy.deepcopy(ref["hf"]).to(torch.bfloat16)
    with torch.no_grad():
        hf_lps = [torch.log_softmax(hf_bf16(torch.tensor([p])).logits[0].float(), -1) for p in prompts]
    lps = runner(build(ref).to(torch.bfloat16), dtype=torch.bfloat16).prefill(prompts)
    for got, hf_got, w in zip(lps, hf_lps, want):
        ours, theirs = float((got - w).abs().mean()), float((hf_got - w).abs().mean())
        assert ours <= 1.25 * theirs + 0.01, (ours, theirs)


def test_mtp_block_is_built_and_loaded(ref):
    cfg = ref["cfg"]
    assert cfg.num_mtp_layers == 1
    model = GlmMoeDsaForCausalLM(cfg)
    names = set(model.state_dict())
    mtp = {n for n in names if n.startswith(f"model.layers.{cfg.num_layers}.")}
    for leaf in ("enorm.weight", "hnorm.weight", "eh_proj.weight", "shared_head.norm.weight",
                 "self_attn.indexer.wq_b.weight", "mlp.experts.gate_up_proj", "input_layernorm.weight"):
        assert f"model.layers.{cfg.num_layers}.{leaf}" in mtp
    assert names - mtp == set(ref["hf"].state_dict())
    assert GlmMoeDsaForCausalLM.checkpoint_has_mtp(cfg, names)
    assert not GlmMoeDsaForCausalLM.checkpoint_has_mtp(cfg, ref["hf"].state_dict())
    sd = {**ref["hf"].state_dict(), **{n: torch.full_like(t, 0.5) for n, t in model.state_dict().items() if n in mtp}}
    model.load_state_dict(sd, strict=True)
    assert torch.equal(model.model.layers[cfg.num_layers].eh_proj.weight,
                       torch.full_like(model.model.layers[cfg.num_layers].eh_proj.weight, 0.5))
    # the trunk ignores the MTP block
    lps = runner(model.eval()).prefill(ref["prompts"][:1])
    assert max_err(lps, ref["logprobs"][:1]) <= TOL


def test_wrong_architecture_is_rejected(ref):
    with pytest.raises(ValueError, match="arch"):
        GlmMoeDsaForCausalLM(dataclasses.replace(ref["cfg"], arch="llama"))
