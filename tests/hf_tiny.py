"""Tiny seeded transformers models used as numerical oracles (glm5-architecture §4)."""

from __future__ import annotations

import torch


# ---- glm5_next (GLM-5.3-Flash), spec §4.1 + §4.3 ------------------------------------------

GLM5_NEXT_TINY_TEXT = dict(
    vocab_size=512, hidden_size=128, intermediate_size=256, moe_intermediate_size=64,
    num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=4,
    n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2, n_group=1, topk_group=1,
    routed_scaling_factor=2.5, norm_topk_prob=True,
    q_lora_rank=64, kv_lora_rank=32, qk_nope_head_dim=32, qk_rope_head_dim=0, v_head_dim=32,
    index_n_heads=2, index_head_dim=32, index_topk=8, index_kpool=4,
    index_kpool_always_select_tail=True,
    layer_types=["linear_attention", "indexed_attention", "indexed_attention",
                 "linear_attention", "linear_attention", "indexed_attention"],
    indexer_types=["full", "full", "shared", "full", "full", "full"],
    mlp_layer_types=["dense", "sparse", "sparse", "sparse", "dense", "sparse"],
    linear_num_heads=2, linear_head_dim=32, linear_conv_kernel_dim=4, linear_lower_bound=-5.0,
    hc_mult=4, hc_eps=1e-6, hc_sinkhorn_iters=20, swiglu_limit=10.0,
    rms_norm_eps=1e-5, max_position_embeddings=4096, pad_token_id=0, tie_word_embeddings=False,
    initializer_range=0.05,
)


def glm5_next_hf_config(**text_overrides):
    from transformers import Glm5NextConfig

    cfg = Glm5NextConfig(
        text_config={**GLM5_NEXT_TINY_TEXT, **text_overrides},
        vision_config=dict(depth=1, hidden_size=32, num_heads=2, intermediate_size=64,
                           out_hidden_size=GLM5_NEXT_TINY_TEXT["hidden_size"], projection_intermediate_size=64),
        tie_word_embeddings=False,
    )
    cfg._attn_implementation = "eager"
    return cfg


@torch.no_grad()
def randomise_glm5_next_constants(module: torch.nn.Module, seed: int) -> None:
    """Replace the reference's constant inits (ones / zeros) so every parameter is exercised."""
    gen = torch.Generator().manual_seed(seed + 1000)

    def noise(t, std):
        return torch.randn(t.shape, generator=gen, dtype=torch.float32).to(t.dtype) * std

    for name, t in list(module.named_parameters()) + list(module.named_buffers()):
        if ".visual." in f".{name}":
            continue
        leaf = name.rsplit(".", 1)[-1]
        if leaf == "index_kpool_compress_gate":
            t.copy_(noise(t, 0.1))
        elif leaf == "index_kpool_compress_ape":
            t.copy_(noise(t, 0.5))
        elif leaf == "A_log":
            t.copy_(noise(t, 0.5))
        elif leaf in ("base", "e_score_correction_bias") or name.endswith("k_norm.bias"):
            t.add_(noise(t, 0.1))
        elif leaf == "scale" or (leaf == "weight" and t.dim() == 1):
            t.add_(noise(t, 0.1))   # hc scales and every norm weight (all ones at init)


@torch.no_grad()
def make_indexers_tie_free(module: torch.nn.Module) -> None:
    """§4.3: mirror the indexer query heads (second half = -first half) and share the head
    weights, so each pool score is |q.k|-like and ReLU-zero ties vanish."""
    for sub in module.modules():
        if not (hasattr(sub, "wq_b") and hasattr(sub, "weights_proj")):
            continue
        heads = sub.weights_proj.weight.shape[0]
        if heads % 2:
            raise ValueError("tie-free indexer weights need an even index_n_heads")
        half = heads // 2
        wq = sub.wq_b.weight.view(heads, -1, sub.wq_b.weight.shape[-1])
        wq[half:] = -wq[:half]
        sub.weights_proj.weight[half:] = sub.weights_proj.weight[:half]


def make_hf_glm5_next(seed: int = 0, **text_overrides):
    """Seeded fp32 ``Glm5NextForConditionalGeneration`` (tiny vision tower, eval mode)."""
    from transformers import Glm5NextForConditionalGeneration

    torch.manual_seed(seed)
    model = Glm5NextForConditionalGeneration(glm5_next_hf_config(**text_overrides)).eval()
    randomise_glm5_next_constants(model, seed)
    make_indexers_tie_free(model)
    return model


def glm5_next_text_state_dict(model) -> dict[str, torch.Tensor]:
    """The language model + lm_head part of a reference state_dict (flashlane's parameter names)."""
    return {k: v for k, v in model.state_dict().items() if not k.startswith("model.visual.")}


# ---- glm_moe_dsa (GLM-5 / 5.x), spec §4.2 + §4.3 -------------------------------------------

GLM_MOE_DSA_TINY = dict(
    vocab_size=512, hidden_size=128, intermediate_size=256, moe_intermediate_size=64,
    num_hidden_layers=5, num_attention_heads=4, num_key_value_heads=4,
    n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2,
    q_lora_rank=64, kv_lora_rank=32, qk_nope_head_dim=24, qk_rope_head_dim=8, v_head_dim=32,
    index_n_heads=2, index_head_dim=32, index_topk=8, first_k_dense_replace=1,
    indexer_types=["full", "shared", "shared", "full", "shared"],
    rope_parameters={"rope_theta": 8000000.0, "rope_type": "default"},
    max_position_embeddings=4096, pad_token_id=0, bos_token_id=1, eos_token_id=2,
    initializer_range=0.05,
)


def glm_moe_dsa_hf_config(**overrides):
    from transformers import GlmMoeDsaConfig

    cfg = GlmMoeDsaConfig(**{**GLM_MOE_DSA_TINY, **overrides})
    cfg._attn_implementation = "eager"
    return cfg


def make_hf_glm_moe_dsa(seed: int = 0, **overrides):
    """Seeded fp32 ``GlmMoeDsaForCausalLM`` (eval mode) with tie-free indexers and randomised
    norm weights / router bias / indexer LayerNorm."""
    from transformers import GlmMoeDsaForCausalLM

    torch.manual_seed(seed)
    model = GlmMoeDsaForCausalLM(glm_moe_dsa_hf_config(**overrides)).eval()
    randomise_glm5_next_constants(model, seed)   # generic: 1-D weights, biases, router bias
    make_indexers_tie_free(model)
    return model
