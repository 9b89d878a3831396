"""The input of a DeepSeek-style next-token-prediction (nextn / MTP) block (spec §1.10).

Drafting token ``t+2`` at position ``t``: ``z = eh_proj([enorm(Embed(token_{t+1})) ;
hnorm(h_t)])`` where ``h_t`` is the target's final post-norm hidden state at ``t`` (or, for a
chained draft, the MTP block's own output there). The embedding is zeroed at position 0, as
vLLM does. Each model's MTP layer runs its block on ``z`` and returns ``shared_head.norm``;
the logits come from the shared LM head.
"""

from __future__ import annotations

import torch
from torch import nn

from .forward_batch import ForwardBatch


def call_draft(layer: nn.Module, embed_tokens: nn.Module, batch: ForwardBatch, hidden: torch.Tensor) -> torch.Tensor:
    """How a model calls its MTP layer: ``layer.draft(embed_tokens, batch, hidden)``. A model's
    ``mtp(batch, hidden, draft_call=...)`` takes another caller of this signature (static graphs
    run the layer through a compiled region)."""
    return layer.draft(embed_tokens, batch, hidden)


def mtp_input(layer: nn.Module, embed_tokens: nn.Module, batch: ForwardBatch, hidden: torch.Tensor) -> torch.Tensor:
    """``batch.input_ids`` hold each position's *next* token; ``hidden`` [N, H] the previous hidden states."""
    e = embed_tokens(batch.input_ids)
    e = e.masked_fill((batch.positions == 0)[:, None], 0.0)
    return layer.eh_proj(torch.cat([layer.enorm(e), layer.hnorm(hidden.to(e.dtype))], dim=-1))
