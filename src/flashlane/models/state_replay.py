"""Rolling per-sequence state forward over tokens already computed once (speculative decoding).

A verify forward records what each stateful layer saw (``ForwardBatch.record``: the KDA mixer's
input, the pooled indexer's input). When a sequence rejects drafts, its state rows are restored
from before the verify step and only these layers advance again over the kept tokens, from their
recorded inputs: the inputs of a kept token do not depend on the drafts after it (causality),
so the state ends where a run without drafts leaves it, for a fraction of a forward (no MoE,
no attention, no other layer).
"""

from __future__ import annotations

import torch
from torch import nn

from .dsa_attention import Indexer
from .forward_batch import ForwardBatch
from .kda_attention import KDAAttention


class StateReplay:
    def __init__(self, model: nn.Module):
        self.layers = [m for m in model.modules()
                       if isinstance(m, KDAAttention) or (isinstance(m, Indexer) and m.kpool > 1)]

    def __call__(self, record: dict, rows: torch.Tensor, batch: ForwardBatch) -> None:
        """``record`` from the verify forward, ``rows`` of its tokens that ``batch`` (the kept
        tokens of the rejecting sequences, from their restored state) covers, in batch order."""
        for layer in self.layers:
            x = record.get(layer.layer_id)
            if x is not None:
                layer.replay_state(x[rows], batch)
