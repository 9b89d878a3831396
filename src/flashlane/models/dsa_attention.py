"""DSA layer: MLA attention (NoPE or decoupled RoPE) restricted to the tokens its indexer selects.

Works on flattened mixed batches. Per call it writes the new tokens' latent row
``[ckv | k_rope]`` (and, on full-indexer layers, their index keys), selects the positions every
query attends (or reuses ``shared_selection`` from the previous full layer) and runs sparse MLA
over them (the backend picks the absorbed or the expanded form per step). Spec §1.6-1.8 and §2.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..config import ModelConfig
from ..kernels.backends import KernelBackend
from ..trace_ranges import profiling_range
from .forward_batch import ForwardBatch
from .layers import Fp32Linear, KeepFp32, RMSNorm


def _rope_front(ops: KernelBackend, x: torch.Tensor, dim: int, cos_sin) -> torch.Tensor:
    """RoPE on the first ``dim`` channels of the last axis (the indexer's ``[rope | nope]`` layout)."""
    if cos_sin is None or dim == 0:
        return x
    return torch.cat([ops.rope(x[..., :dim], *cos_sin), x[..., dim:]], dim=-1)


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
        self.rope_theta = cfg.rope_theta
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
        cache, ops = batch.cache, batch.ops
        row = cache.spec.index_row(self.layer_id)
        keys, key_scale = cache.layer("index_keys", row), cache.layer("index_keys_scale", row)
        q = _rope_front(ops, self.wq_b(cq).view(n, self.n_heads, self.head_dim), self.rope_dim, cos_sin)
        w = self.weights_proj(x.to(self.weights_proj.weight.dtype)).float() * self.n_heads ** -0.5
        if self.kpool > 1:
            batch.keep_input(self.layer_id, x)
        self._write_keys(x, batch, cos_sin)
        return ops.select_positions(q, w, keys, key_scale, batch, topk=batch.index_topk or self.topk,
                                    kpool=self.kpool, always_select_tail=self.always_select_tail)

    def _write_keys(self, x: torch.Tensor, batch: ForwardBatch, cos_sin) -> None:
        cache, ops = batch.cache, batch.ops
        row = cache.spec.index_row(self.layer_id)
        keys, key_scale = cache.layer("index_keys", row), cache.layer("index_keys_scale", row)
        k = _rope_front(ops, self.k_norm(self.wk(x)), self.rope_dim, cos_sin)
        if self.kpool == 1:
            ops.write_index_keys(keys, k, key_scale, batch)
        else:
            ops.write_index_keys(keys, k, key_scale, batch, kpool=self.kpool,
                                 gates=F.linear(x, self.index_kpool_compress_gate),
                                 ape=self.index_kpool_compress_ape, tail=cache.layer("index_tail", row),
                                 steps=batch.step_states("index_tail", row))

    @torch.no_grad()
    def tail_entries(self, x: torch.Tensor, positions: torch.Tensor, ops: KernelBackend) -> torch.Tensor:
        """The ``[key | gate]`` tail-ring entries [N, 2D] of tokens whose layer input is ``x``
        (what ``write_index_keys`` keeps for a pool's members), in the ring's dtype."""
        cos_sin = ops.rope_cos_sin(positions, self.rope_dim, self.rope_theta) if self.rope_dim else None
        k = _rope_front(ops, self.k_norm(self.wk(x)), self.rope_dim, cos_sin)
        return torch.cat([k, F.linear(x, self.index_kpool_compress_gate)], dim=-1)

    @torch.no_grad()
    def replay_state(self, x: torch.Tensor, batch: ForwardBatch) -> None:
        """Rewrite the pooled keys and the tail ring (per-sequence state) of tokens whose layer
        input ``x`` was recorded (a speculative rollback)."""
        cos_sin = batch.ops.rope_cos_sin(batch.positions, self.rope_dim, self.rope_theta) if self.rope_dim else None
        self._write_keys(x, batch, cos_sin)


class DSAAttention(nn.Module):
    """MLA + DSA for one layer. ``forward(x [N, H] normed, batch, shared_selection) -> (out [N, H],
    selection [N, K] int64 absolute positions, -1 = empty)``."""

    def __init__(self, cfg: ModelConfig, layer_id: int, indexer_type: str | None = None):
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
        self.rope_theta = cfg.rope_theta

    def forward(self, x: torch.Tensor, batch: ForwardBatch,
                shared_selection: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        n = x.shape[0]
        ops = batch.ops
        cq = self.q_a_layernorm(self.q_a_proj(x), ops)
        q = self.q_b_proj(cq).view(n, self.num_heads, self.nope + self.rope_dim)
        q_nope, q_rope = q.split([self.nope, self.rope_dim], dim=-1)
        c, k_rope = self.kv_a_proj_with_mqa(x).split([self.kv_lora_rank, self.rope_dim], dim=-1)
        ckv = self.kv_a_layernorm(c, ops)
        cos_sin = None
        if self.rope_dim:
            cos_sin = ops.rope_cos_sin(batch.positions, self.rope_dim, self.rope_theta)
            q_rope, k_rope = ops.rope(q_rope, *cos_sin), ops.rope(k_rope, *cos_sin)

        cache, row = batch.cache, batch.cache.spec.latent_row(self.layer_id)
        latent = cache.layer("latent", row)
        latent_scale = cache.layer("latent_scale", row)
        ops.write_kv_rows(latent, latent_scale, torch.cat([ckv, k_rope], dim=-1), batch)

        if self.indexer is not None:
            with profiling_range("indexer"):
                selection = self.indexer(x, cq, batch, cos_sin)
        elif shared_selection is None:
            raise ValueError(f"layer {self.layer_id}: a shared-indexer DSA layer needs shared_selection "
                             "from the previous full layer")
        else:
            selection = shared_selection

        w_kv = self.kv_b_proj.weight.view(self.num_heads, self.nope + self.v_dim, self.kv_lora_rank)
        o = ops.sparse_mla(q_nope, q_rope if self.rope_dim else None, latent, latent_scale, selection, batch,
                           scale=self.scale, w_kv=w_kv)
        return self.o_proj(o.reshape(n, self.num_heads * self.v_dim)), selection


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
