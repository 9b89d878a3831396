"""Sparse MLA in the non-absorbed ("MHA") form for prefill chunks, and the rule that picks a form.

The absorbed form (``sparse_mla``) attends in latent space: every query folds W_k into its query,
scores against ``K`` selected latent rows of width C + R and leaves a latent output for W_v.
This form instead decompresses each *distinct* row that any query of a sequence's chunk selected
once, with the kv up-projection ``w_kv`` [H, Dn + Dv, C], into per-head keys and values, and
attends in head space: score_j = q_nope . k_nope_j + q_rope . k_rope_j, out = sum_j p_j v_j.
Both give the same [N, H, Dv] (up to rounding). Softmax in fp32.

Two attention paths: while a chunk's d distinct rows are at most ``DENSE_ROWS_PER_TOPK * K``,
every query scores all d rows in one dense matmul, masked to its own selection (more FLOPs, but
matmul speed); beyond that each query gathers its K decompressed rows (H (Dn + R + Dv) values per
row where the absorbed form gathers C + R: memory-bound on CPU).

Selections are assumed duplicate-free per query (the indexer's top-k is): on the dense path a
position selected twice counts once.
"""

from __future__ import annotations

import torch

from .kv_store import gather_rows
from .paged import paged_rows

# Max elements of one block's gathered rows [queries, K, H, 2 Dn + Dv] or dense scores [H, queries, d].
_GATHER_BLOCK = 1 << 24

# Dense path while d <= this * K. Measured once by hand (tiny-standard shape, 1 thread, both paths
# forced): the gathered path overtakes the dense one between d/K = 16 and 32.
DENSE_ROWS_PER_TOPK = 16

# What one FLOP of each expanded path costs in absorbed-form FLOPs on CPU; the rule weighs the
# expanded FLOPs by them. Fitted by benchmarks/mla_forms.py (results/mla_forms.json: median over
# its rows of the time-per-FLOP ratio; 0.35 and 1.23 on an AVX512 EPYC, one thread, tiny-standard
# and tiny-flash shapes). The rule then takes the expanded form only for first chunks of <= 64
# tokens; it disagrees with the measurement only at rows where both forms are within noise
# (sub-ms calls, paired ratio 0.8-1.4 from run to run).
EXPANDED_DENSE_FLOP_COST = 0.35
EXPANDED_GATHERED_FLOP_COST = 1.25


def dense_path(distinct: int, topk: int) -> bool:
    """Whether the expanded form scores all ``distinct`` rows densely (else it gathers K per query)."""
    return distinct <= DENSE_ROWS_PER_TOPK * topk


def mla_form_flops(n: int, distinct: int, *, heads: int, kv_rank: int, rope_dim: int, nope_dim: int,
                   v_dim: int, topk: int) -> tuple[int, int]:
    """(absorbed, expanded) FLOPs of sparse MLA for ``n`` queries that select ``topk`` rows each
    among ``distinct`` = d distinct latent rows (H heads, latent C, rope R, Dn, Dv):

    - absorbed: 2 n H (Dn C + K (2C + R) + C Dv) -- fold W_k into the query, score and sum
      K latent rows of width C + R (values: their C part), apply W_v to the latent output;
    - expanded: 2 (d H C (Dn + Dv) + n H J (Dn + R + Dv)) -- decompress the d distinct rows once,
      then score and sum J head-space rows per query: J = d on the dense path, else K.
    """
    h, c, r, dn, dv, k = heads, kv_rank, rope_dim, nope_dim, v_dim, topk
    absorbed = 2 * n * h * (dn * c + k * (2 * c + r) + c * dv)
    keys = distinct if dense_path(distinct, k) else k
    expanded = 2 * (distinct * h * c * (dn + dv) + n * h * keys * (dn + r + dv))
    return absorbed, expanded


def prefer_expanded(chunks: list[tuple[int, int]], *, heads: int, kv_rank: int, rope_dim: int, nope_dim: int,
                    v_dim: int, topk: int) -> bool:
    """Whether this step's prefill chunks, ``(new tokens, context length)`` per sequence, run the
    expanded form: summed over the chunks, its FLOPs (``mla_form_flops``) weighted by the cost of
    the path each chunk takes (``EXPANDED_*_FLOP_COST``) are below the absorbed form's. Shapes
    only: a chunk's distinct rows are taken as min(context, n * topk), their upper bound. Decode
    tokens are not chunks here; they always run absorbed."""
    absorbed = expanded = 0.0
    for n, ctx in chunks:
        d = min(ctx, n * topk)
        a, e = mla_form_flops(n, d, heads=heads, kv_rank=kv_rank, rope_dim=rope_dim, nope_dim=nope_dim,
                              v_dim=v_dim, topk=topk)
        absorbed += a
        expanded += e * (EXPANDED_DENSE_FLOP_COST if dense_path(d, topk) else EXPANDED_GATHERED_FLOP_COST)
    return bool(chunks) and expanded < absorbed


def sparse_mla_expanded(q_nope: torch.Tensor, q_rope: torch.Tensor | None, latent: torch.Tensor,
                        selection: torch.Tensor, w_kv: torch.Tensor, *, spans: list[tuple[int, int, int]],
                        block_tables: torch.Tensor, page_size: int, scale: float,
                        latent_scale: torch.Tensor | None = None) -> torch.Tensor:
    """q_nope [N, H, Dn], q_rope [N, H, R] or None, latent [rows, C + R] (int8 with
    ``latent_scale``), selection [N, K] absolute positions (-1 = empty), w_kv [H, Dn + Dv, C]
    -> [N, H, Dv]. ``spans``: (first token, end token, sequence) of each prefill chunk, the
    sequence being its row of ``block_tables``; tokens outside every span, and queries with
    nothing selected, get zeros."""
    n, h, dn = q_nope.shape
    dv = w_kv.shape[1] - dn
    c = w_kv.shape[2]
    if latent.shape[-1] != c + (0 if q_rope is None else q_rope.shape[-1]):
        raise ValueError(f"latent row width {latent.shape[-1]} does not match C ({c}) + rope width")
    out = q_nope.new_zeros(n, h, dv)
    w_up = w_kv.reshape(h * (dn + dv), c)
    for a, e, s in spans:
        if a == e:
            continue
        sel = selection[a:e]
        valid = sel >= 0
        # position 0 stands in for empty entries (masked below): one extra row at most
        pos, inv = torch.unique(sel.masked_fill(~valid, 0), return_inverse=True)
        rows = paged_rows(block_tables, torch.full((1,), s, dtype=torch.long, device=sel.device), pos[None],
                          page_size)[0]
        kv = gather_rows(latent, latent_scale, rows, q_nope.dtype)                     # [d, C + R]
        up = torch.matmul(kv[:, :c], w_up.t()).view(-1, h, dn + dv)                    # [d, H, Dn + Dv]
        k_nope, v = up[..., :dn].transpose(0, 1).contiguous(), up[..., dn:].transpose(0, 1).contiguous()  # [H, d, *]
        k_rope = kv[:, c:] if q_rope is not None and q_rope.shape[-1] else None
        qr = None if k_rope is None else q_rope[a:e]
        dense = dense_path(pos.shape[0], sel.shape[1])
        attend = _attend_dense if dense else _attend_gathered
        per_query = h * pos.shape[0] if dense else sel.shape[1] * h * (2 * dn + dv)
        block = max(1, _GATHER_BLOCK // max(1, per_query))
        for i in range(0, e - a, block):
            j = slice(i, min(i + block, e - a))
            out[a + j.start:a + j.stop] = attend(q_nope[a:e][j], None if qr is None else qr[j], k_nope, k_rope, v,
                                                 inv[j], valid[j], scale)
    return out


def _softmax(scores: torch.Tensor, keep: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    scores = scores.float().masked_fill(~keep, float("-inf"))
    return torch.nan_to_num(torch.softmax(scores, dim=-1), nan=0.0).to(dtype)


def _attend_dense(q, qr, k_nope, k_rope, v, inv, valid, scale: float) -> torch.Tensor:
    """Every query against all d distinct rows, masked to its own selection."""
    scores = torch.matmul(q.transpose(0, 1), k_nope.transpose(1, 2))                  # [H, n, d]
    if k_rope is not None:
        scores = scores + torch.matmul(qr, k_rope.t()).transpose(0, 1)
    scores = scores * scale
    # added, not written: an empty entry points at a row the query may also select
    keep = torch.zeros(inv.shape[0], k_nope.shape[1], dtype=torch.int32, device=inv.device)
    keep.scatter_add_(1, inv, valid.to(torch.int32))
    prob = _softmax(scores, keep[None] > 0, q.dtype)
    return torch.matmul(prob, v).transpose(0, 1)                                       # [n, H, Dv]


def _attend_gathered(q, qr, k_nope, k_rope, v, inv, valid, scale: float) -> torch.Tensor:
    """Each query against its own K decompressed rows (k_nope, v head-major: [H, d, *], gathered
    as [H, n, K, *] so both products are batched matmuls without a permuted copy)."""
    scores = torch.matmul(q.transpose(0, 1).unsqueeze(2), k_nope[:, inv].transpose(-1, -2)).squeeze(2)  # [H, n, K]
    if k_rope is not None:
        scores = scores + torch.matmul(qr, k_rope[inv].transpose(1, 2)).transpose(0, 1)
    prob = _softmax(scores * scale, valid[None], q.dtype)
    return torch.matmul(prob.unsqueeze(2), v[:, inv]).squeeze(2).transpose(0, 1)                       # [n, H, Dv]
