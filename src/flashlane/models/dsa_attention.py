"""DSA layer: MLA attention (NoPE or decoupled RoPE) restricted to the tokens its indexer selects.

Works on flattened mixed batches. Per call it writes the new tokens' latent row
``[ckv | k_rope]`` (and, on full-indexer layers, their index keys), selects the positions every
query attends (or reuses ``shared_selection`` from the previous full layer) and runs absorbed
sparse MLA over them. Spec §1.6-1.8 and §2.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..config import ModelConfig
from ..kernels.indexer import select_positions, select_positions_decode, write_index_keys
from ..kernels.kv_store import write_rows
from ..kernels.rope import RopeCache, apply_rope
from ..kernels.sparse_mla import sparse_mla_attention
from ..trace_ranges import profiling_range
from .forward_batch import ForwardBatch
from .layers import Fp32Linear, KeepFp32, RMSNorm


def _rope_cos_sin(rope: RopeCache | None, batch: ForwardBatch):
    return None if rope is None else rope.cos_sin(batch.positions)


def _rope_front(x: torch.Tensor, dim: int, cos_sin) -> torch.Tensor:
    """RoPE on the first ``dim`` channels of the last axis (the indexer's ``[rope | nope]`` layout)."""
    if cos_sin is None or dim == 0:
        return x
    return torch.cat([apply_rope(x[..., :dim], *cos_sin), x[..., dim:]], dim=-1)


class Indexer(KeepFp32):
    """Lightning indexer weights and per-call flow (projection -> key cache write -> selection)."""

    fp32_names = ("index_kpool_compress_ape",)

    def __init__(self, cfg: ModelConfig, layer_id: int):
        super().__init__()
        self.layer_id = layer_id
        self.n_heads, self.head_dim = cfg.index_n_heads, cfg.index_head_dim
        self.rope_dim = cfg.qk_rope_head_dim
        self.topk, self.kpool = cfg.index_topk, cfg.index_kpool
        self.always_select_tail = cfg.index_always_select_tail
        if self.rope_dim > self.head_dim:
            raise ValueError(f"qk_rope_head_dim ({self.rope_dim}) exceeds index_head_dim ({self.head_dim})")
        self.wq_b = nn.Linear(cfg.q_lora_rank, self.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(cfg.hidden_size, self.head_dim, bias=False)
        self.k_norm = nn.LayerNorm(self.head_dim, eps=1e-6)
        self.weights_proj = Fp32Linear(cfg.hidden_size, self.n_heads, bias=False)
        if self.kpool > 1:
            self.index_kpool_compress_gate = nn.Parameter(torch.ones(self.head_dim, cfg.hidden_size))
            self.index_kpool_compress_ape = nn.Parameter(torch.zeros(self.kpool, self.head_dim))

    @torch.no_grad()
    def forward(self, x: torch.Tensor, cq: torch.Tensor, batch: ForwardBatch, cos_sin=None) -> torch.Tensor:
        n = x.shape[0]
        cache, spec = batch.cache, batch.cache.spec
        row = spec.index_row_of[self.layer_id]
        key_scale = cache.layer("index_keys_scale", row)
        q = _rope_front(self.wq_b(cq).view(n, self.n_heads, self.head_dim), self.rope_dim, cos_sin)
        k = _rope_front(self.k_norm(self.wk(x)), self.rope_dim, cos_sin)
        w = self.weights_proj(x.to(self.weights_proj.weight.dtype)).float() * self.n_heads ** -0.5
        if self.kpool == 1:
            write_index_keys(cache.layer("index_keys", row), k, slot_mapping=batch.slot_mapping, page_size=spec.page_size,
                             key_scale=key_scale)
        else:
            q_lens = batch.cu_q[1:] - batch.cu_q[:-1]
            write_index_keys(
                cache.layer("index_keys", row), k, slot_mapping=batch.slot_mapping, page_size=spec.page_size,
                kpool=self.kpool, gates=F.linear(x, self.index_kpool_compress_gate),
                ape=self.index_kpool_compress_ape, tail=cache.layer("index_tail", row), positions=batch.positions,
                seq_of_token=batch.seq_of_token, start_of_seq=batch.ctx_lens_t - q_lens,
                ctx_of_seq=batch.ctx_lens_t, block_tables=batch.block_tables, state_slots=batch.state_slots,
                key_scale=key_scale)
        topk = batch.index_topk or self.topk
        if batch.static:
            return select_positions_decode(
                q, w, cache.layer("index_keys", row), positions=batch.positions, block_tables=batch.block_tables,
                page_size=spec.page_size, topk=topk, kpool=self.kpool, always_select_tail=self.always_select_tail,
                key_scale=key_scale)
        return select_positions(
            q, w, cache.layer("index_keys", row), positions=batch.positions, q_lens=batch.q_lens,
            ctx_lens=batch.ctx_lens, block_tables=batch.block_tables, page_size=spec.page_size,
            topk=topk, kpool=self.kpool, always_select_tail=self.always_select_tail,
            key_scale=key_scale)


class DSAAttention(nn.Module):
    """MLA + DSA for one layer. ``forward(x [N, H] normed, batch, shared_selection) -> (out [N, H],
    selection [N, K] int64 absolute positions, -1 = empty)``."""

    def __init__(self, cfg: ModelConfig, layer_id: int, rope: RopeCache | None = None,
                 indexer_type: str | None = None):
        super().__init__()
        self.layer_id = layer_id
        self.num_heads = cfg.num_heads
        self.nope, self.rope_dim, self.v_dim = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
        self.kv_lora_rank = cfg.kv_lora_rank
        self.scale = (self.nope + self.rope_dim) ** -0.5
        h = cfg.hidden_size
        self.q_a_proj = nn.Linear(h, cfg.q_lora_rank, bias=False)
        self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, cfg.mla_norm_eps)
        self.q_b_proj = nn.Linear(cfg.q_lora_rank, self.num_heads * (self.nope + self.rope_dim), bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(h, self.kv_lora_rank + self.rope_dim, bias=False)
        self.kv_a_layernorm = RMSNorm(self.kv_lora_rank, cfg.mla_norm_eps)
        self.kv_b_proj = nn.Linear(self.kv_lora_rank, self.num_heads * (self.nope + self.v_dim), bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.v_dim, h, bias=False)
        kind = indexer_type or cfg.indexer_types[layer_id]
        if kind not in ("full", "shared"):
            raise ValueError(f"layer {layer_id}: DSA indexer type must be 'full' or 'shared', got {kind!r}")
        self.indexer = Indexer(cfg, layer_id) if kind == "full" else None
        if self.rope_dim and rope is None:
            rope = RopeCache(self.rope_dim, cfg.rope_theta)
        self.rope = rope if self.rope_dim else None

    def forward(self, x: torch.Tensor, batch: ForwardBatch,
                shared_selection: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        n = x.shape[0]
        spec = batch.cache.spec
        cq = self.q_a_layernorm(self.q_a_proj(x))
        q = self.q_b_proj(cq).view(n, self.num_heads, self.nope + self.rope_dim)
        q_nope, q_rope = q.split([self.nope, self.rope_dim], dim=-1)
        c, k_rope = self.kv_a_proj_with_mqa(x).split([self.kv_lora_rank, self.rope_dim], dim=-1)
        ckv = self.kv_a_layernorm(c)
        cos_sin = _rope_cos_sin(self.rope, batch)
        if cos_sin is not None:
            q_rope, k_rope = apply_rope(q_rope, *cos_sin), apply_rope(k_rope, *cos_sin)

        cache, row = batch.cache, spec.latent_row(self.layer_id)
        latent = cache.layer("latent", row)
        latent_scale = cache.layer("latent_scale", row)
        write_rows(latent, latent_scale, batch.slot_mapping, torch.cat([ckv, k_rope], dim=-1))

        if self.indexer is not None:
            with profiling_range("indexer"):
                selection = self.indexer(x, cq, batch, cos_sin)
        elif shared_selection is None:
            raise ValueError(f"layer {self.layer_id}: a shared-indexer DSA layer needs shared_selection "
                             "from the previous full layer")
        else:
            selection = shared_selection

        w_kv = self.kv_b_proj.weight.view(self.num_heads, self.nope + self.v_dim, self.kv_lora_rank)
        q_latent = torch.einsum("nhd,hdc->nhc", q_nope, w_kv[:, : self.nope])
        o_latent = sparse_mla_attention(
            q_latent, q_rope if self.rope_dim else None, latent, selection,
            block_tables=batch.block_tables, seq_of_token=batch.seq_of_token,
            page_size=spec.page_size, scale=self.scale, latent_scale=latent_scale)
        o = torch.einsum("nhc,hvc->nhv", o_latent, w_kv[:, self.nope:]).reshape(n, self.num_heads * self.v_dim)
        return self.o_proj(o), selection


def check_index_topk(cfg: ModelConfig, topk: int) -> None:
    """Validate an inference-time override of the selection size (``ForwardBatch.index_topk``;
    the weights do not depend on it). Raises ValueError naming ``index_topk``."""
    if not cfg.full_indexer_layers:
        raise ValueError(f"index_topk is set, but this {cfg.arch} model has no sparse-attention indexer "
                         "(only glm_moe_dsa / glm5_next DSA layers select tokens)")
    if isinstance(topk, bool) or not isinstance(topk, int) or topk < 1:
        raise ValueError(f"index_topk must be an integer >= 1, got {topk!r}")
    kpool = max(cfg.index_kpool, 1)
    if topk % kpool:
        raise ValueError(f"index_topk ({topk}) must be a multiple of the model's index_kpool ({kpool})")
