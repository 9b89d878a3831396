"""Drafting with the model's own MTP (next-token-prediction) layer, as SGLang and vLLM do for GLM
and DeepSeek: after every step the MTP layer runs over the positions the step committed (its
own latent + indexer cache must cover every position), and from the last one it drafts ``k``
tokens by feeding each draft back through itself. The drafts wait on the request for the next
step, where the scheduler proposes them and the target verifies them.

Position ``p`` of the MTP layer reads the token at ``p + 1`` and the target's hidden state at
``p``, so its cache row depends on the token *after* ``p``. A prefix-cache hit ends at a page
boundary whose next token may differ from the request that wrote the page: that row is
recomputed from the target hidden state saved at the end of every page (``mtp_hidden`` in
``cache_spec``), and with pooled index keys its pool's key is rebuilt from the MTP indexer's
entries of the page's other last ``kpool - 1`` tokens, saved beside it (``mtp_ring``) and put
back into the tail ring first (the ring itself has moved on since).
Chained drafts write the MTP layer's rows past the committed tokens (into pages the scheduler
reserved ahead, ``lookahead``); those rows are overwritten by the next step's pass, and the
MTP layer's indexer tail (per-sequence state) is put back after the chain. With static graphs
the MTP layer runs in a compiled region of its own where its batch can be decode rows (``_mtp``).
"""

from __future__ import annotations

import torch

from ...models.dsa_attention import Indexer
from ...models.forward_batch import ForwardBatch


class MtpDrafter:
    """Scheduler side: hands out the drafts the runner's MTP pass left on the request."""

    def __init__(self, num_tokens: int):
        self.num_tokens = num_tokens
        self.lookahead = num_tokens    # pages reserved past a decode step for the chained drafts

    def draft(self, req, limit: int) -> list[int]:
        return req.draft_token_ids[: min(limit, self.num_tokens)]


class MtpPass:
    """Runner side: the MTP layer's catch-up over a step's committed positions, then the drafts."""

    def __init__(self, model, cache, num_tokens: int, index_topk: int | None, ops, compiled=None):
        self.model, self.cache, self.k = model, cache, num_tokens
        self.index_topk, self.ops = index_topk, ops
        self.compiled = compiled if compiled is not None and compiled.mtp else None   # static graphs
        spec = cache.spec
        self.page, self.kpool = spec.page_size, spec.kpool
        layer = spec.mtp_layers[0]
        pools = cache.tensors.pools
        self.hidden_pool = pools["mtp_hidden"][0]                    # [pages, H]
        self.ring_pool = pools["mtp_ring"][0] if "mtp_ring" in pools else None    # [pages * (kpool-1), 2D]
        tail = cache.tensors.layer("index_tail", spec.index_row(layer))
        self.tail = tail                                             # [state rows, kpool, 2D] or None
        self.indexer = next(m for m in model.modules() if isinstance(m, Indexer) and m.layer_id == layer)
        self.state_rows = {"index_tail": [spec.index_row(layer)]} if tail is not None else {}
        self.calls = self.rows = self.logit_rows = 0   # the last pass's MTP layer calls, rows, drafted rows

    def _batch(self, tokens, starts, tables, slots) -> ForwardBatch:
        return ForwardBatch.build(tokens, starts, tables, slots, self.cache.tensors, self.index_topk, ops=self.ops)

    def _mtp(self, tokens, starts, tables, slots, h: torch.Tensor) -> torch.Tensor:
        """The MTP layer over sequences' new tokens: through its static graphs where their shape
        allows (one token per sequence; any number where the layer keeps no per-sequence state,
        each token a row of its own, as a verify step's; with its indexer tail, the same number
        per sequence, one of ``mtp_rows``), else eagerly."""
        self.calls += 1
        self.rows += sum(len(t) for t in tokens)
        c = self.compiled
        counts = {len(t) for t in tokens}
        if c is not None and (self.tail is None or counts == {1}):
            if h.shape[0] <= c.max_size:
                return c.draft(c.batch_rows(tokens, starts, tables, slots), h)
        elif c is not None and len(counts) == 1 and len(tokens) <= c.max_size and (q := counts.pop()) in c.mtp_rows:
            return c.draft(c.batch_verify(tokens, starts, tables, slots, q), h)
        return self.model.mtp(self._batch(tokens, starts, tables, slots), h)

    def run(self, seqs, starts: list[int], tables, slots, cu: list[int], hidden: torch.Tensor, results) -> None:
        """After a step's forward (and any rollback): ``hidden`` holds the target's rows of every
        scheduled token (sequence ``b`` from ``cu[b]``); ``results`` what each sequence gained."""
        self.calls = self.rows = self.logit_rows = 0
        toks, st, tb, sl, parts, last, members, gained_of = [], [], [], [], [], [], [], []
        page_ends = []            # (row in the MTP batch, page): the target hidden saved per page
        ring_rows = []            # (row in the MTP batch, flat mtp_ring row)
        at = 0
        for b, s in enumerate(seqs):
            req, c = s.req, starts[b]
            res = results[b]
            gained = res.tokens if res.tokens is not None else [] if res.token is None else [res.token]
            m = s.num_known + (len(gained) - 1 if s.draft else 0)
            known = req.all_token_ids
            nxt = (known[c + 1: c + s.num_known] + gained) if gained else known[c + 1: c + s.num_known + 1]
            m = min(m, len(nxt))
            redo = c > 0 and req.mtp_position != c
            if m == 0 and not redo:       # nothing committed with a known next token
                req.draft_token_ids = []
                continue
            if redo:
                self._put_back_ring(req, c, tables[b], slots[b])
                parts.append(self.hidden_pool[tables[b][(c - 1) // self.page]][None])
            toks.append(([known[c]] if redo else []) + nxt[:m])
            st.append(c - 1 if redo else c)
            parts.append(hidden[cu[b]: cu[b] + m])
            at += redo
            for j in range(m):
                p, page = c + j, tables[b][(c + j) // self.page]
                offset = p % self.page - (self.page - self.kpool)
                if offset == self.kpool - 1:
                    page_ends.append((at + j, page))
                elif offset >= 0:
                    ring_rows.append((at + j, page * (self.kpool - 1) + offset))
            at += m
            req.mtp_position = c + m
            last.append(at - 1)
            members.append(b)
            gained_of.append(gained)
            tb.append(tables[b])
            sl.append(slots[b])
        if not members:
            return
        h_in = torch.cat(parts)
        if page_ends:
            rows, pages = zip(*page_ends)
            self.hidden_pool[torch.tensor(pages, dtype=torch.long)] = h_in[torch.tensor(rows, dtype=torch.long)]
        if not ring_rows:
            out = self._mtp(toks, st, tb, sl, h_in)
        else:              # the ring's entries come from the layer's recorded input: eager
            batch = self._batch(toks, st, tb, sl)
            batch.record = {}
            self.calls += 1
            self.rows += sum(len(t) for t in toks)
            out = self.model.mtp(batch, h_in)
            rows, flat = (torch.tensor(x, dtype=torch.long) for x in zip(*ring_rows))
            x = batch.record[self.indexer.layer_id][rows]
            self.ring_pool[flat] = self.indexer.tail_entries(x, batch.positions[rows], self.ops).to(self.ring_pool.dtype)
        self._draft([seqs[b] for b in members], tb, sl, gained_of, out[torch.tensor(last, dtype=torch.long)])

    def _put_back_ring(self, req, c: int, table: list[int], slot: int) -> None:
        """Before recomputing a prefix hit's last MTP row (position ``c - 1``): the ring entries
        of the other members of its pool, saved with the page."""
        if c % self.page:
            raise RuntimeError(f"request {req.request_id}: the MTP cache ends at {req.mtp_position}, the "
                               f"step starts at {c}, which is not a page boundary")
        if self.ring_pool is None:
            return
        page = table[(c - 1) // self.page]
        saved = self.ring_pool[page * (self.kpool - 1): (page + 1) * (self.kpool - 1)]
        members = [(c - self.kpool + i) % self.kpool for i in range(self.kpool - 1)]
        self.tail[slot, torch.tensor(members, dtype=torch.long)] = saved.to(self.tail.dtype)

    def _draft(self, seqs, tables, slots, gained_of, h_last: torch.Tensor) -> None:
        """Chain up to ``k`` drafts for every sequence that will decode next; the others get none."""
        want = []
        for b, s in enumerate(seqs):
            req, gained = s.req, gained_of[b]
            p = req.params
            left = req.max_tokens - len(req.output_token_ids) - len(gained) - 1
            ok = gained and p.logprobs is None and req.grammar is None
            want.append(min(self.k, left) if ok else 0)
            req.draft_token_ids = []
        active = [b for b, w in enumerate(want) if w > 0]
        if not active:
            return
        h = h_last[torch.tensor(active, dtype=torch.long)]
        self.logit_rows += h.shape[0]
        token = self.model.compute_logits(h).argmax(dim=-1).tolist()
        for b, t in zip(active, token):
            seqs[b].req.draft_token_ids.append(t)
        # chained steps: the MTP layer's rows past the committed tokens, in pages reserved ahead
        room = {b: min(want[b], len(tables[b]) * self.page - seqs[b].req.mtp_position + 1) for b in active}
        chain = [b for b in active if room[b] > 1]
        if not chain:
            return
        kept = self._keep_state(seqs, slots, chain)
        try:
            step = 1
            while chain:
                at = [active.index(b) for b in chain]
                h = h[torch.tensor(at, dtype=torch.long)] if len(at) != h.shape[0] else h
                reqs = [seqs[b].req for b in chain]
                h = self._mtp([[r.draft_token_ids[-1]] for r in reqs], [r.mtp_position + step - 1 for r in reqs],
                              [tables[b] for b in chain], [slots[b] for b in chain], h)
                self.logit_rows += h.shape[0]
                for r, t in zip(reqs, self.model.compute_logits(h).argmax(dim=-1).tolist()):
                    r.draft_token_ids.append(t)
                step += 1
                active = chain
                chain = [b for b in chain if room[b] > step]
        finally:
            self._restore_state(kept)

    def _keep_state(self, seqs, slots, chain) -> list[tuple[int, int]]:
        """The MTP layer's per-sequence state (its indexer tail) before chained drafts move it."""
        if not self.state_rows:
            return []
        pairs = [(slots[b], self.cache.draft_row(seqs[b].req)) for b in chain]
        for slot, row in pairs:
            self.cache.snapshots.copy(slot, row, self.state_rows)
        return pairs

    def _restore_state(self, pairs) -> None:
        for slot, row in pairs:
            self.cache.snapshots.copy(row, slot, self.state_rows)
