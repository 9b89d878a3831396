"""Parameter counts by component, total and active per token, from the config alone.

Counted tensors are exactly those of the transformers in-memory state dict (= flashlane's
parameter names), including persistent buffers such as the router's correction bias, plus the
MTP draft layer(s) that checkpoints ship at index ``num_layers``. "Active" counts what one
ordinary decoding step touches: every non-expert tensor, the shared expert(s) and
``num_experts_per_tok`` routed experts per MoE layer; the MTP layer is not active unless
speculative decoding runs (``active_with_mtp``).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..config import ModelConfig

COMPONENTS = (
    "embedding", "head", "norms", "mhc", "kda", "mla", "attn", "indexer",
    "dense_ffn", "router", "shared_experts", "routed_experts", "mtp",
)


@dataclass(frozen=True)
class ParamCounts:
    total_by: dict[str, int]
    active_by: dict[str, int]
    mtp_active: int            # active share of the MTP layer(s) when drafting

    @property
    def total(self) -> int:
        return sum(self.total_by.values())

    @property
    def active(self) -> int:
        return sum(v for k, v in self.active_by.items() if k != "mtp")

    @property
    def total_without_mtp(self) -> int:
        return self.total - self.total_by["mtp"]

    @property
    def active_with_mtp(self) -> int:
        return self.active + self.mtp_active

    @property
    def active_without_embedding(self) -> int:
        return self.active - self.active_by["embedding"]


# ---- per-module counts (one function per module kind) --------------------------------------

def mla_params(cfg: ModelConfig) -> int:
    h, heads = cfg.hidden_size, cfg.num_heads
    qk = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
    return (h * cfg.q_lora_rank + cfg.q_lora_rank                      # q_a_proj, q_a_layernorm
            + cfg.q_lora_rank * heads * qk                             # q_b_proj
            + h * (cfg.kv_lora_rank + cfg.qk_rope_head_dim)            # kv_a_proj_with_mqa
            + cfg.kv_lora_rank                                         # kv_a_layernorm
            + cfg.kv_lora_rank * heads * (cfg.qk_nope_head_dim + cfg.v_head_dim)  # kv_b_proj
            + heads * cfg.v_head_dim * h)                              # o_proj


def indexer_params(cfg: ModelConfig) -> int:
    h, ih, dh = cfg.hidden_size, cfg.index_n_heads, cfg.index_head_dim
    n = ih * dh * cfg.q_lora_rank + dh * h + 2 * dh + ih * h          # wq_b, wk, k_norm (w+b), weights_proj
    if cfg.arch == "glm5_next":                                        # pool gate + ape exist for any kpool
        n += dh * h + cfg.index_kpool * dh
    return n


def kda_params(cfg: ModelConfig) -> int:
    h, heads, d = cfg.hidden_size, cfg.linear_num_heads, cfg.linear_head_dim
    q = heads * d
    return (3 * q * h                      # q, k, v projections
            + 3 * q * cfg.conv_kernel      # depthwise conv [3Q, 1, K]
            + d * h + q * d + q + heads    # forget gate: f_a, f_b, dt_bias, A_log
            + heads * h                    # b_proj
            + d * h + q * d                # output gate g_a, g_b
            + d                            # o_norm
            + q * h)                       # o_proj


def gqa_params(cfg: ModelConfig) -> int:
    h, hd = cfg.hidden_size, cfg.head_dim
    return h * cfg.num_heads * hd * 2 + h * cfg.num_kv_heads * hd * 2   # q, o and k, v


def mlp_params(cfg: ModelConfig, width: int) -> int:
    return 3 * cfg.hidden_size * width


def expert_params(cfg: ModelConfig) -> int:
    return mlp_params(cfg, cfg.moe_intermediate_size)


def router_params(cfg: ModelConfig) -> int:
    return cfg.n_routed_experts * cfg.hidden_size + cfg.n_routed_experts   # weight + correction bias


def mhc_params(cfg: ModelConfig) -> int:
    n = cfg.hc_mult
    per_site = (2 + n) * n * n * cfg.hidden_size + (2 + n) * n + 3
    return 2 * per_site                                                # attn_hc and ffn_hc


def mtp_layer_params(cfg: ModelConfig) -> tuple[int, int]:
    """(total, active) of one MTP layer: enorm, hnorm, eh_proj, DSA block with its own indexer,
    MoE FFN, two block norms, shared_head.norm. It reuses the trunk's embedding and LM head."""
    h = cfg.hidden_size
    fixed = 4 * h + 2 * h * h + mla_params(cfg) + indexer_params(cfg) + h
    moe_fixed = router_params(cfg) + cfg.n_shared_experts * expert_params(cfg)
    routed = cfg.n_routed_experts * expert_params(cfg)
    active_routed = cfg.num_experts_per_tok * expert_params(cfg)
    return fixed + moe_fixed + routed, fixed + moe_fixed + active_routed


# ---- the whole model -------------------------------------------------------------------------

def count_params(cfg: ModelConfig) -> ParamCounts:
    h, v = cfg.hidden_size, cfg.vocab_size
    total = dict.fromkeys(COMPONENTS, 0)
    active = dict.fromkeys(COMPONENTS, 0)
    total["embedding"] = v * h
    total["head"] = 0 if cfg.tie_word_embeddings else v * h
    total["norms"] = 2 * h * cfg.num_layers + h                       # block norms + final norm
    if cfg.arch == "glm5_next":
        total["mhc"] = mhc_params(cfg) * cfg.num_layers
    for i in range(cfg.num_layers):
        mixer = cfg.mixer_types[i]
        if mixer == "kda":
            total["kda"] += kda_params(cfg)
        elif mixer == "dsa":
            total["mla"] += mla_params(cfg)
            if cfg.indexer_types[i] == "full":
                total["indexer"] += indexer_params(cfg)
        else:
            total["attn"] += gqa_params(cfg)
        if cfg.ffn_types[i] == "dense":
            total["dense_ffn"] += mlp_params(cfg, cfg.intermediate_size)
        else:
            total["router"] += router_params(cfg)
            total["shared_experts"] += cfg.n_shared_experts * expert_params(cfg)
            total["routed_experts"] += cfg.n_routed_experts * expert_params(cfg)
    active.update({k: n for k, n in total.items() if k not in ("routed_experts", "mtp")})
    n_moe = cfg.ffn_types.count("moe")
    active["routed_experts"] = n_moe * cfg.num_experts_per_tok * expert_params(cfg)
    mtp_total = mtp_active = 0
    if cfg.arch != "llama" and cfg.num_mtp_layers:
        one_total, one_active = mtp_layer_params(cfg)
        mtp_total, mtp_active = one_total * cfg.num_mtp_layers, one_active * cfg.num_mtp_layers
    total["mtp"] = mtp_total
    return ParamCounts(total_by=total, active_by=active, mtp_active=mtp_active)


def component_of(name: str, cfg: ModelConfig) -> str:
    """The component a state-dict tensor name (flashlane = transformers in-memory names) counts under."""
    short = name
    for prefix in ("model.language_model.", "model."):
        if short.startswith(prefix):
            short = short[len(prefix):]
            break
    if short.startswith("embed_tokens."):
        return "embedding"
    if short.startswith("lm_head."):
        return "head"
    if short == "norm.weight":
        return "norms"
    parts = short.split(".")
    if parts[0] != "layers" or len(parts) < 3 or not parts[1].isdigit():
        raise ValueError(f"tensor {name!r} does not belong to a known component")
    layer, rest = int(parts[1]), ".".join(parts[2:])
    if layer >= cfg.num_layers:
        return "mtp"
    if rest.startswith(("attn_hc.", "ffn_hc.")):
        return "mhc"
    if rest.startswith(("input_layernorm.", "post_attention_layernorm.")):
        return "norms"
    if rest.startswith("self_attn.indexer."):
        return "indexer"
    if rest.startswith("self_attn."):
        return {"kda": "kda", "dsa": "mla", "attn": "attn"}[cfg.mixer_types[layer]]
    if rest.startswith("mlp.gate."):
        return "router"
    if rest.startswith("mlp.shared_experts."):
        return "shared_experts"
    if rest.startswith("mlp.experts."):
        return "routed_experts"
    if rest.startswith("mlp."):
        return "dense_ffn"
    raise ValueError(f"tensor {name!r} does not belong to a known component")
