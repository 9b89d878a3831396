"""What a model forward receives: flattened tokens of many sequences plus batch metadata.

Sequences in one call mix prefill chunks (many new tokens) and decode steps (one new token).
Token ``j`` of sequence ``b`` sits at flat index ``cu_q[b] + j`` and absolute position
``ctx_lens[b] - q_lens[b] + j``. Every new token's cache row is written at
``slot_mapping`` (``page * page_size + offset``) in each paged pool; sequence ``b`` reads its
history through ``block_tables[b]`` and its per-sequence state through ``state_slots[b]``.
Page 0 and state slot 0 are null (padding targets), never handed to a sequence.
``ops`` is the kernel backend the model runs its ops through (``kernels.backends``; chosen once by
the engine, default: the preferred one for the cache's device).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..kernels.backends import KernelBackend, select_backend
from .cache_tensors import CacheTensors


@dataclass
class ForwardBatch:
    input_ids: torch.Tensor        # [N] int64
    positions: torch.Tensor        # [N] int64, absolute position within its sequence
    q_lens: list[int] | None       # new tokens per sequence (None: ``static``)
    ctx_lens: list[int] | None     # tokens per sequence after this call (cached + new; None: ``static``)
    cu_q: torch.Tensor             # [B + 1] int64
    ctx_lens_t: torch.Tensor       # [B] int64
    block_tables: torch.Tensor     # [B, max_pages] int64, 0-padded
    slot_mapping: torch.Tensor     # [N] int64 flat token row in the paged pools
    state_slots: torch.Tensor      # [B] int64 (0 when the model keeps no per-sequence state)
    seq_of_token: torch.Tensor     # [N] int64, which sequence each token belongs to
    cache: CacheTensors
    index_topk: int | None = None  # DSA selection size overriding the config's (engine ``index_topk``)
    # A padded decode batch (``padded_decode``): one token per sequence, row b = sequence b, no
    # host-side lists (``q_lens``/``ctx_lens`` are None), so a compiled forward sees only tensors
    # of fixed shapes. The kernel backend's ops take their branch-free paths for it.
    static: bool = False
    ops: KernelBackend | None = None   # None: select_backend(cache.device)
    # speculative decoding: the layers that keep per-sequence state put the inputs they saw here
    # (layer id -> [N, hidden]), so a rollback recomputes only that state (``models.state_replay``)
    record: dict | None = None
    # A static verify batch (``padded_verify``): every sequence has this many new tokens, its
    # rows ``b * rows_per_seq + j``; the stateful layers also keep their state after each token
    # but the last (``step_states``), so a rollback copies one back instead of replaying.
    rows_per_seq: int = 1

    def __post_init__(self) -> None:
        if self.ops is None:
            self.ops = select_backend(self.cache.device)

    @property
    def page_size(self) -> int:
        return self.cache.spec.page_size

    @property
    def num_seqs(self) -> int:
        return self.state_slots.shape[0] if self.static else len(self.q_lens)

    @property
    def is_decode(self) -> bool:
        if self.static:
            return self.rows_per_seq == 1
        return all(q == 1 for q in self.q_lens)

    def keep_input(self, layer_id: int, x: torch.Tensor) -> None:
        """A stateful layer's input over this (eager) batch's tokens, kept in ``record`` for a
        speculative rollback's replay."""
        if self.record is not None:
            self.record[layer_id] = x

    def step_states(self, pool: str, row: int) -> torch.Tensor | None:
        """Where a stateful layer keeps its state (slot pool ``pool``, layer row ``row``) after
        each token of a static verify batch but the last, or None: the compiled step's per-layer
        cache view carries these buffers (``engine.cache.snapshots.StepStates``); other batches
        and the MTP layer's catch-up keep nothing."""
        return self.cache.layer(f"{pool}_steps", row) if self.rows_per_seq > 1 else None

    @property
    def start_lens(self) -> list[int]:
        return [c - q for c, q in zip(self.ctx_lens, self.q_lens)]

    @classmethod
    def build(cls, new_tokens: list[list[int]], start_lens: list[int], block_tables: list[list[int]],
              state_slots: list[int], cache: CacheTensors, index_topk: int | None = None,
              ops: KernelBackend | None = None) -> "ForwardBatch":
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
        dev = cache.device
        t = lambda x: torch.tensor(x, dtype=torch.long, device=dev)  # noqa: E731
        return cls(
            input_ids=t(ids), positions=t(pos), q_lens=q_lens, ctx_lens=ctx, cu_q=cu.to(dev),
            ctx_lens_t=t(ctx), block_tables=tables.to(dev), slot_mapping=t(slots),
            state_slots=t(state_slots), seq_of_token=t(owner), cache=cache, index_topk=index_topk, ops=ops,
        )

    @classmethod
    def padded_verify(cls, tokens: list[list[int]], starts: list[int], block_tables: list[list[int]],
                      state_slots: list[int], cache: CacheTensors, size: int, width: int, q: int,
                      index_topk: int | None = None, ops: KernelBackend | None = None) -> "ForwardBatch":
        """Sequences of exactly ``q`` new tokens each (a speculative verify step: the last known
        token and its drafts; ``padded_decode`` with q = 1), from position ``starts[b]``, padded to
        ``size`` sequences of ``q`` rows on the null page and slot and block tables of ``width``
        pages. Padding rows sit at positions 0..q-1 on the null page and the null state slot, so
        whatever they write lands where nothing reads."""
        n, page = len(tokens), cache.spec.page_size
        if any(len(t) != q for t in tokens) or n > size or any(len(t) > width for t in block_tables):
            raise ValueError(f"padded batch: {n} sequences of {sorted({len(t) for t in tokens})} tokens / "
                             f"{max(map(len, block_tables), default=0)} pages exceed the bucket of {size} "
                             f"sequences of {q} tokens x {width} pages")
        tables = torch.zeros(size, width, dtype=torch.long)
        for b, t in enumerate(block_tables):
            tables[b, : len(t)] = torch.tensor(t, dtype=torch.long)
        first = torch.tensor(list(starts) + [0] * (size - n), dtype=torch.long)
        pos = (first[:, None] + torch.arange(q)).reshape(-1)
        seq = torch.arange(size).repeat_interleave(q)
        slot_mapping = tables[seq, pos // page] * page + pos % page
        slot_mapping[n * q:] = 0
        dev = cache.device
        t = lambda x: torch.tensor(x, dtype=torch.long, device=dev)  # noqa: E731
        return cls(
            input_ids=t([x for toks in tokens for x in toks] + [0] * ((size - n) * q)), positions=pos.to(dev),
            q_lens=None, ctx_lens=None, cu_q=torch.arange(size + 1, device=dev) * q,
            ctx_lens_t=(first + q).to(dev), block_tables=tables.to(dev), slot_mapping=slot_mapping.to(dev),
            state_slots=t(list(state_slots) + [0] * (size - n)), seq_of_token=seq.to(dev),
            cache=cache, index_topk=index_topk, static=True, ops=ops, rows_per_seq=q,
        )

    @classmethod
    def padded_decode(cls, tokens: list[int], positions: list[int], block_tables: list[list[int]],
                      state_slots: list[int], cache: CacheTensors, size: int, width: int,
                      index_topk: int | None = None, ops: KernelBackend | None = None) -> "ForwardBatch":
        """One new token per sequence at ``positions[b]``, padded to ``size`` sequences and block
        tables of ``width`` pages (``padded_verify`` with one token per sequence)."""
        return cls.padded_verify([[t] for t in tokens], positions, block_tables, state_slots, cache, size, width, 1,
                                 index_topk, ops)
