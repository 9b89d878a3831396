"""What a model forward receives: flattened tokens of many sequences plus batch metadata.

Sequences in one call mix prefill chunks (many new tokens) and decode steps (one new token).
Token ``j`` of sequence ``b`` sits at flat index ``cu_q[b] + j`` and absolute position
``ctx_lens[b] - q_lens[b] + j``. Every new token's cache row is written at
``slot_mapping`` (``page * page_size + offset``) in each paged pool; sequence ``b`` reads its
history through ``block_tables[b]`` and its per-sequence state through ``state_slots[b]``.
Page 0 and state slot 0 are null (padding targets), never handed to a sequence.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..cache_spec import CacheSpec


@dataclass
class CacheTensors:
    """The pool tensors. Rows are indexed through ``spec`` (layer id -> row)."""

    spec: CacheSpec
    num_pages: int
    num_slots: int
    latent: torch.Tensor | None       # [latent rows, num_pages * page_size, latent_dim]
    index_keys: torch.Tensor | None   # [index rows, num_pages * page_size // kpool, index_dim]
    index_tail: torch.Tensor | None   # [index rows, num_slots + 1, kpool, 2 * index_dim]  (kI | gI)
    conv: torch.Tensor | None         # [kda rows, num_slots + 1, conv_dim, conv_width]
    recurrent: torch.Tensor | None    # [kda rows, num_slots + 1, H, Dk, Dv], float32

    @classmethod
    def allocate(cls, spec: CacheSpec, num_pages: int, num_slots: int,
                 dtype: torch.dtype, device: torch.device | str = "cpu") -> "CacheTensors":
        tokens = num_pages * spec.page_size

        def zeros(*shape, dt=dtype):
            return torch.zeros(*shape, dtype=dt, device=device) if shape[0] else None

        slots = num_slots + 1 if spec.needs_state_slot else 0
        return cls(
            spec=spec,
            num_pages=num_pages,
            num_slots=num_slots,
            latent=zeros(len(spec.latent_layers), tokens, spec.latent_dim),
            index_keys=zeros(len(spec.index_layers), tokens // spec.kpool, spec.index_dim),
            index_tail=zeros(len(spec.index_layers), slots, spec.kpool, 2 * spec.index_dim)
            if spec.kpool > 1 and slots else None,
            conv=zeros(len(spec.kda_layers), slots, spec.conv_dim, spec.conv_width) if slots else None,
            recurrent=zeros(len(spec.kda_layers), slots, *spec.state_shape, dt=torch.float32)
            if slots else None,
        )

    def clear_slot(self, slot: int) -> None:
        """Zero a sequence's per-sequence state (stale state is a classic bug)."""
        for t in (self.conv, self.recurrent, self.index_tail):
            if t is not None:
                t[:, slot].zero_()

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in
                   (self.latent, self.index_keys, self.index_tail, self.conv, self.recurrent) if t is not None)


@dataclass
class ForwardBatch:
    input_ids: torch.Tensor        # [N] int64
    positions: torch.Tensor        # [N] int64, absolute position within its sequence
    q_lens: list[int]              # new tokens per sequence
    ctx_lens: list[int]            # tokens per sequence after this call (cached + new)
    cu_q: torch.Tensor             # [B + 1] int64
    ctx_lens_t: torch.Tensor       # [B] int64
    block_tables: torch.Tensor     # [B, max_pages] int64, 0-padded
    slot_mapping: torch.Tensor     # [N] int64 flat token row in the paged pools
    state_slots: torch.Tensor      # [B] int64 (0 when the model keeps no per-sequence state)
    seq_of_token: torch.Tensor     # [N] int64, which sequence each token belongs to
    cache: CacheTensors

    @property
    def num_seqs(self) -> int:
        return len(self.q_lens)

    @property
    def is_decode(self) -> bool:
        return all(q == 1 for q in self.q_lens)

    @property
    def start_lens(self) -> list[int]:
        return [c - q for c, q in zip(self.ctx_lens, self.q_lens)]

    @classmethod
    def build(cls, new_tokens: list[list[int]], start_lens: list[int], block_tables: list[list[int]],
              state_slots: list[int], cache: CacheTensors) -> "ForwardBatch":
        """Assemble the metadata for sequences whose first ``start_lens[b]`` tokens are cached."""
        page = cache.spec.page_size
        q_lens = [len(t) for t in new_tokens]
        ctx = [s + q for s, q in zip(start_lens, q_lens)]
        ids, pos, slots, owner = [], [], [], []
        for b, (toks, s) in enumerate(zip(new_tokens, start_lens)):
            table = block_tables[b]
            if len(table) * page < s + len(toks):
                raise ValueError(f"sequence {b}: {len(table)} pages cannot hold {s + len(toks)} tokens")
            ids.extend(toks)
            p = range(s, s + len(toks))
            pos.extend(p)
            slots.extend(table[i // page] * page + i % page for i in p)
            owner.extend([b] * len(toks))
        width = max((len(t) for t in block_tables), default=0)
        tables = torch.zeros(len(block_tables), max(width, 1), dtype=torch.long)
        for b, t in enumerate(block_tables):
            tables[b, : len(t)] = torch.tensor(t, dtype=torch.long)
        cu = torch.zeros(len(q_lens) + 1, dtype=torch.long)
        cu[1:] = torch.cumsum(torch.tensor(q_lens, dtype=torch.long), 0)
        dev = cache.latent.device if cache.latent is not None else "cpu"
        t = lambda x: torch.tensor(x, dtype=torch.long, device=dev)  # noqa: E731
        return cls(
            input_ids=t(ids), positions=t(pos), q_lens=q_lens, ctx_lens=ctx, cu_q=cu.to(dev),
            ctx_lens_t=t(ctx), block_tables=tables.to(dev), slot_mapping=t(slots),
            state_slots=t(state_slots), seq_of_token=t(owner), cache=cache,
        )
