"""Sparse MLA attention in absorbed (latent-space) form over per-query selected positions.

Each query attends the positions its indexer chose (absolute positions of its own sequence,
``-1`` = empty), read from the paged latent pool whose rows are ``[ckv (C) | k_rope (R)]``.
With the key/value up-projection absorbed: score_j = (W_k^T q_nope) . ckv_j + q_rope . k_rope_j,
output (in latent space) = sum_j p_j ckv_j; the caller applies W_v and the output projection.
Softmax in fp32. Queries are processed in blocks so the gathered latents stay bounded.
"""

from __future__ import annotations

import torch

from .kv_store import gather_rows
from .paged import paged_rows

# Max elements of one gathered [queries, selected, latent] block.
_GATHER_BLOCK = 1 << 24


def sparse_mla_attention(q_latent: torch.Tensor, q_rope: torch.Tensor | None, latent: torch.Tensor,
                         selection: torch.Tensor, *, block_tables: torch.Tensor,
                         seq_of_token: torch.Tensor, page_size: int, scale: float,
                         latent_scale: torch.Tensor | None = None) -> torch.Tensor:
    """q_latent [N, H, C] (absorbed query), q_rope [N, H, R] or None, latent [rows, C + R]
    (int8 with ``latent_scale`` [rows, G], see ``kv_store``), selection [N, K] -> [N, H, C].
    A query with nothing selected gets zeros."""
    n, h, c = q_latent.shape
    k = selection.shape[1]
    q = q_latent if q_rope is None or q_rope.shape[-1] == 0 else torch.cat([q_latent, q_rope], dim=-1)
    if q.shape[-1] != latent.shape[-1]:
        raise ValueError(f"query width {q.shape[-1]} does not match latent row width {latent.shape[-1]}")
    block = max(1, _GATHER_BLOCK // max(1, k * latent.shape[-1]))
    if n <= block:    # one block (every decode step): no loop over a possibly symbolic n
        return _attend(q, latent, latent_scale, selection, block_tables, seq_of_token, page_size, scale, c)
    out = q_latent.new_empty(n, h, c)
    for a in range(0, n, block):
        out[a:a + block] = _attend(q[a:a + block], latent, latent_scale, selection[a:a + block], block_tables,
                                   seq_of_token[a:a + block], page_size, scale, c)
    return out


def _attend(q, latent, latent_scale, sel, block_tables, seq_of_token, page_size: int, scale: float,
            c: int) -> torch.Tensor:
    rows = paged_rows(block_tables, seq_of_token, sel, page_size)
    kv = gather_rows(latent, latent_scale, rows, q.dtype)
    scores = torch.matmul(q, kv.transpose(1, 2)) * scale                               # [n, H, K]
    scores = scores.float().masked_fill((sel < 0)[:, None, :], float("-inf"))
    prob = torch.nan_to_num(torch.softmax(scores, dim=-1), nan=0.0).to(q.dtype)
    return torch.matmul(prob, kv[..., :c])

