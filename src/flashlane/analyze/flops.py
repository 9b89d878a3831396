"""FLOPs per token (decode at a given context) and per prefill, from the config alone.

Conventions (printed by the report as assumptions):
* a multiply-add is 2 FLOPs; matmuls against weights cost 2 x (weight elements) per token;
  norms, activations, softmax, gating and top-k selection are not counted;
* context-dependent attention = indexer scoring over visible keys (one pooled key per
  ``kpool`` tokens for glm5_next, one per token for glm_moe_dsa, full layers only) + sparse MLA
  over the selected positions (``min(T, topk)`` plus the always-selected tail of the incomplete
  pool) + the KDA recurrence (+ its short conv); for llama, dense attention over all T;
* MLA is counted in the absorbed form (scores against the cached latent): per head and attended
  position 2(kv_lora + rope) for the score and 2 kv_lora for the value sum. ``form="expanded"``
  counts keys/values expanded per head instead (2(nope + rope) + 2 v);
* KDA decode uses the recurrent form, 7 D^2 per head per token (decay, S^T k, rank-1 update,
  S^T q); prefill uses the chunked (WY) form, 6 D^2 + 7 C D per head per token (C = 64: three
  intra-chunk C x C products, the triangular solve, three products with the chunk-start state);
* the MTP draft layer is not counted (ordinary decoding).
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from ..config import ModelConfig

KDA_CHUNK = 64


@dataclass(frozen=True)
class TokenFlops:
    projections: float        # attention, indexer and KDA weight matmuls
    ffn: float                # dense FFN, router, shared and routed experts
    mhc: float                # hyper-connection projections and stream mixing
    head: float               # LM head
    indexer_scoring: float
    sparse_attention: float   # MLA over selected positions (llama: dense attention)
    kda_recurrence: float     # recurrence + short conv

    @property
    def attention(self) -> float:
        return self.indexer_scoring + self.sparse_attention + self.kda_recurrence

    @property
    def total(self) -> float:
        return sum(getattr(self, f.name) for f in fields(self))

    def as_dict(self) -> dict[str, float]:
        out = {f.name: getattr(self, f.name) for f in fields(self)}
        out["attention"] = self.attention
        out["total"] = self.total
        return out


# ---- weight matmuls (context independent) ----------------------------------------------------

def _mla_matmul(cfg: ModelConfig) -> int:
    h, heads = cfg.hidden_size, cfg.num_heads
    qk = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
    return (h * cfg.q_lora_rank + cfg.q_lora_rank * heads * qk + h * (cfg.kv_lora_rank + cfg.qk_rope_head_dim)
            + cfg.kv_lora_rank * heads * (cfg.qk_nope_head_dim + cfg.v_head_dim) + heads * cfg.v_head_dim * h)


def _indexer_matmul(cfg: ModelConfig) -> int:
    h, ih, dh = cfg.hidden_size, cfg.index_n_heads, cfg.index_head_dim
    n = ih * dh * cfg.q_lora_rank + dh * h + ih * h
    return n + (dh * h if cfg.arch == "glm5_next" else 0)   # pool gate projection


def _kda_matmul(cfg: ModelConfig) -> int:
    h, heads, d = cfg.hidden_size, cfg.linear_num_heads, cfg.linear_head_dim
    q = heads * d
    return 4 * q * h + 2 * (d * h + q * d) + heads * h


def _gqa_matmul(cfg: ModelConfig) -> int:
    return 2 * cfg.hidden_size * cfg.head_dim * (cfg.num_heads + cfg.num_kv_heads)


def _mhc_per_layer(cfg: ModelConfig) -> int:
    n, h = cfg.hc_mult, cfg.hidden_size
    proj = 2 * (2 + n) * n * n * h          # fn matmul
    mix = 2 * n * h + 2 * n * n * h + 2 * n * h   # collapse, C^T X, post (x) y + add
    return 2 * (proj + mix)                  # attention site and FFN site


def _ffn_per_token(cfg: ModelConfig, kind: str) -> int:
    h = cfg.hidden_size
    if kind == "dense":
        return 2 * 3 * h * cfg.intermediate_size
    experts = cfg.num_experts_per_tok + cfg.n_shared_experts
    return 2 * (3 * h * cfg.moe_intermediate_size * experts + cfg.n_routed_experts * h)


def fixed_per_token(cfg: ModelConfig) -> dict[str, float]:
    proj = ffn = mhc = 0
    for i in range(cfg.num_layers):
        mixer = cfg.mixer_types[i]
        if mixer == "kda":
            proj += 2 * _kda_matmul(cfg)
        elif mixer == "dsa":
            proj += 2 * _mla_matmul(cfg)
            if cfg.indexer_types[i] == "full":
                proj += 2 * _indexer_matmul(cfg)
        else:
            proj += 2 * _gqa_matmul(cfg)
        ffn += _ffn_per_token(cfg, cfg.ffn_types[i])
        if cfg.arch == "glm5_next":
            mhc += _mhc_per_layer(cfg)
    return {"projections": proj, "ffn": ffn, "mhc": mhc, "head": 2 * cfg.vocab_size * cfg.hidden_size}


# ---- context-dependent pieces ---------------------------------------------------------------

def _pool(cfg: ModelConfig) -> int:
    return max(cfg.index_kpool, 1)


def attended_positions(cfg: ModelConfig, t: int) -> int:
    """Positions a DSA query at context ``t`` (visible tokens, itself included) attends."""
    p = _pool(cfg)
    n_sel = cfg.index_topk // p
    tail = t % p if (p > 1 and cfg.index_always_select_tail) else 0
    return p * min(t // p, n_sel) + tail


def scored_keys(cfg: ModelConfig, t: int) -> int:
    """Indexer keys (pools) a query at context ``t`` scores: the complete visible ones."""
    return t // _pool(cfg)


def _sum_floor(n: int, p: int) -> int:
    """sum_{t=1..n} floor(t / p)."""
    if n <= 0:
        return 0
    q, r = divmod(n, p)
    return p * q * (q - 1) // 2 + q * (r + 1)


def _sum_mod(n: int, p: int) -> int:
    """sum_{t=1..n} (t mod p)."""
    if n <= 0:
        return 0
    q, r = divmod(n, p)
    return q * p * (p - 1) // 2 + r * (r + 1) // 2


def _sum_min_floor(n: int, p: int, m: int) -> int:
    """sum_{t=1..n} min(floor(t / p), m)."""
    cut = m * p - 1
    return _sum_floor(min(n, cut), p) + m * max(0, n - cut)


def sum_attended(cfg: ModelConfig, n: int) -> int:
    """sum_{t=1..n} attended_positions(t)."""
    p = _pool(cfg)
    total = p * _sum_min_floor(n, p, cfg.index_topk // p)
    if p > 1 and cfg.index_always_select_tail:
        total += _sum_mod(n, p)
    return total


def sum_scored(cfg: ModelConfig, n: int) -> int:
    return _sum_floor(n, _pool(cfg))


def _per_position_mla(cfg: ModelConfig, form: str) -> int:
    heads = cfg.num_heads
    if form == "absorbed":
        return 2 * heads * (cfg.kv_lora_rank + cfg.qk_rope_head_dim) + 2 * heads * cfg.kv_lora_rank
    if form == "expanded":
        return 2 * heads * (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim) + 2 * heads * cfg.v_head_dim
    raise ValueError(f"MLA form {form!r} is neither 'absorbed' nor 'expanded'")


def _per_key_indexer(cfg: ModelConfig) -> int:
    return 2 * cfg.index_n_heads * cfg.index_head_dim + 2 * cfg.index_n_heads


def _kda_per_token(cfg: ModelConfig, chunked: bool) -> int:
    d, heads = cfg.linear_head_dim, cfg.linear_num_heads
    per_head = 6 * d * d + 7 * KDA_CHUNK * d if chunked else 7 * d * d
    conv = 2 * 3 * heads * d * cfg.conv_kernel
    return heads * per_head + conv


def _layer_counts(cfg: ModelConfig) -> tuple[int, int, int, int]:
    return (cfg.mixer_types.count("dsa"), len(cfg.full_indexer_layers),
            cfg.mixer_types.count("kda"), cfg.mixer_types.count("attn"))


def decode_flops(cfg: ModelConfig, context: int, form: str = "absorbed") -> TokenFlops:
    """FLOPs of one new token whose visible context (itself included) is ``context`` tokens."""
    if context <= 0:
        raise ValueError(f"context must be positive, got {context}")
    n_dsa, n_full, n_kda, n_attn = _layer_counts(cfg)
    attn = n_dsa * attended_positions(cfg, context) * _per_position_mla(cfg, form) if n_dsa else 0
    attn += n_attn * 4 * cfg.num_heads * cfg.head_dim * context
    return TokenFlops(
        **fixed_per_token(cfg),
        indexer_scoring=n_full * scored_keys(cfg, context) * _per_key_indexer(cfg),
        sparse_attention=attn,
        kda_recurrence=n_kda * _kda_per_token(cfg, chunked=False),
    )


def prefill_flops(cfg: ModelConfig, new_tokens: int, cached: int = 0, form: str = "absorbed",
                  with_head: bool = False) -> TokenFlops:
    """FLOPs of prefilling ``new_tokens`` after ``cached`` tokens already in the cache.
    The LM head runs only for the last token unless ``with_head`` (prompt logprobs)."""
    if new_tokens <= 0 or cached < 0:
        raise ValueError(f"prefill needs new_tokens > 0 and cached >= 0, got {new_tokens}, {cached}")
    n_dsa, n_full, n_kda, n_attn = _layer_counts(cfg)
    end = cached + new_tokens
    fixed = {k: v * new_tokens for k, v in fixed_per_token(cfg).items()}
    if not with_head:
        fixed["head"] = 2 * cfg.vocab_size * cfg.hidden_size
    attn = n_dsa * (sum_attended(cfg, end) - sum_attended(cfg, cached)) * _per_position_mla(cfg, form)
    attn += n_attn * 4 * cfg.num_heads * cfg.head_dim * (end * (end + 1) - cached * (cached + 1)) // 2
    return TokenFlops(
        **fixed,
        indexer_scoring=n_full * (sum_scored(cfg, end) - sum_scored(cfg, cached)) * _per_key_indexer(cfg),
        sparse_attention=attn,
        kda_recurrence=n_kda * new_tokens * _kda_per_token(cfg, chunked=True),
    )
