"""Analytic parameter counts against transformers' own models (instantiated on the meta device).

Each tensor of the reference state dict is assigned to a component by name, so every component
(embedding, KDA, MLA, indexer, experts, ...) is checked, not just the sum.
"""

from __future__ import annotations

import copy

import pytest
import torch

from flashlane.analyze.models import full_size_preset_dict
from flashlane.analyze.params import COMPONENTS, component_of, count_params
from flashlane.config import parse_config
from flashlane.presets import preset_config


def counted_by_component(state_dict: dict, cfg) -> dict[str, int]:
    out = dict.fromkeys(COMPONENTS, 0)
    seen = set()
    for name, t in state_dict.items():
        if id(t) in seen:        # tied weights appear twice in a state dict
            continue
        seen.add(id(t))
        out[component_of(name, cfg)] += t.numel()
    return out


def _hf_glm5_next(text: dict):
    from transformers import Glm5NextTextConfig
    from transformers.models.glm5_next.modeling_glm5_next import Glm5NextTextModel

    hf_cfg = Glm5NextTextConfig(**text)
    with torch.device("meta"):
        body = Glm5NextTextModel(hf_cfg)
        head = torch.nn.Linear(hf_cfg.hidden_size, hf_cfg.vocab_size, bias=False)
    sd = {f"model.language_model.{k}": v for k, v in body.state_dict(keep_vars=True).items()}
    sd["lm_head.weight"] = head.weight
    return sd


def _hf_glm_moe_dsa(config: dict):
    from transformers import GlmMoeDsaConfig, GlmMoeDsaForCausalLM

    with torch.device("meta"):
        return GlmMoeDsaForCausalLM(GlmMoeDsaConfig(**config)).state_dict(keep_vars=True)


def _hf_llama(config: dict):
    from transformers import LlamaConfig, LlamaForCausalLM

    with torch.device("meta"):
        return LlamaForCausalLM(LlamaConfig(**config)).state_dict(keep_vars=True)


SPEC_TINY_FLASH = dict(  # spec §4.1
    model_type="glm5_next_text", vocab_size=512, hidden_size=128, intermediate_size=256, moe_intermediate_size=64,
    num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8, n_shared_experts=1,
    num_experts_per_tok=2, q_lora_rank=64, kv_lora_rank=32, qk_nope_head_dim=32, qk_rope_head_dim=0,
    v_head_dim=32, index_n_heads=2, index_head_dim=32, index_topk=8, index_kpool=4,
    layer_types=["linear_attention", "indexed_attention", "indexed_attention", "linear_attention",
                 "linear_attention", "indexed_attention"],
    indexer_types=["full", "full", "shared", "full", "full", "full"],
    mlp_layer_types=["dense", "sparse", "sparse", "sparse", "dense", "sparse"],
    linear_num_heads=2, linear_head_dim=32, linear_conv_kernel_dim=4, hc_mult=4, pad_token_id=0)
SPEC_TINY_STANDARD = dict(  # spec §4.2
    model_type="glm_moe_dsa", vocab_size=512, hidden_size=128, intermediate_size=256, moe_intermediate_size=64,
    num_hidden_layers=5, num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8, n_shared_experts=1,
    num_experts_per_tok=2, q_lora_rank=64, kv_lora_rank=32, qk_nope_head_dim=24, qk_rope_head_dim=8,
    v_head_dim=32, index_n_heads=2, index_head_dim=32, index_topk=8, first_k_dense_replace=1,
    indexer_types=["full", "shared", "shared", "full", "shared"],
    rope_parameters={"rope_theta": 8000000.0, "rope_type": "default"}, pad_token_id=0)


def _cases():
    flash_full = full_size_preset_dict("glm-5.3-flash")
    yield "glm-5.3-flash", flash_full, _hf_glm5_next, flash_full["text_config"]
    std_full = full_size_preset_dict("glm-5.3")
    yield "glm-5.3", std_full, _hf_glm_moe_dsa, std_full
    tiny_flash = preset_config("tiny-flash")
    yield "tiny-flash", tiny_flash, _hf_glm5_next, tiny_flash["text_config"]
    yield "tiny-standard", preset_config("tiny-standard"), _hf_glm_moe_dsa, preset_config("tiny-standard")
    yield "spec-4.1", {"model_type": "glm5_next", "text_config": SPEC_TINY_FLASH}, _hf_glm5_next, SPEC_TINY_FLASH
    yield "spec-4.2", SPEC_TINY_STANDARD, _hf_glm_moe_dsa, SPEC_TINY_STANDARD
    smol = preset_config("smollm2-135m")
    yield "smollm2-135m", smol, _hf_llama, smol
    untied = dict(smol, tie_word_embeddings=False, num_hidden_layers=2)
    yield "llama-untied", untied, _hf_llama, untied


@pytest.mark.parametrize("name,config,build,hf_config", list(_cases()), ids=[c[0] for c in _cases()])
def test_params_by_component_equal_transformers(name, config, build, hf_config):
    cfg = parse_config(copy.deepcopy(config))
    counted = counted_by_component(build(copy.deepcopy(hf_config)), cfg)
    analytic = count_params(cfg)
    # transformers has no MTP layer; everything else must agree tensor for tensor
    expected = dict(analytic.total_by, mtp=0)
    assert counted == expected
    assert sum(counted.values()) == analytic.total_without_mtp
