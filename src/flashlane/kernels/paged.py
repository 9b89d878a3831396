"""Address arithmetic of the paged pools: absolute positions of a sequence -> flat pool rows."""

from __future__ import annotations

import torch


def paged_rows(block_tables: torch.Tensor, seq_ids: torch.Tensor, positions: torch.Tensor,
               page_size: int) -> torch.Tensor:
    """Flat row of token ``positions[i, ...]`` of sequence ``seq_ids[i]`` in a paged pool.

    ``positions`` has ``seq_ids``' length as its leading dim. Negative positions (the ``-1`` =
    empty convention) and pages past the table end map to row 0 (inside the null page) so a
    gather stays in bounds; callers mask those entries themselves.
    """
    pos = positions.clamp(min=0)
    page_idx = (pos // page_size).clamp(max=block_tables.shape[1] - 1)
    seq = seq_ids.reshape(-1, *([1] * (pos.dim() - 1))).expand_as(pos)
    rows = block_tables[seq, page_idx] * page_size + pos % page_size
    return rows.masked_fill(positions < 0, 0)


def pooled_rows(block_tables: torch.Tensor, seq_ids: torch.Tensor, pools: torch.Tensor,
                page_size: int, kpool: int) -> torch.Tensor:
    """Entry of pool ``pools[i, ...]`` of sequence ``seq_ids[i]`` in a pooled index-key pool
    (one entry per ``kpool`` tokens; a pool never straddles a page since page_size % kpool == 0)."""
    first = torch.where(pools >= 0, pools * kpool, torch.full_like(pools, -1))
    return paged_rows(block_tables, seq_ids, first, page_size) // kpool
