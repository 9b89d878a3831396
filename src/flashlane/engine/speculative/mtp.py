"""Drafting with the model's own MTP (next-token-prediction) layer, as SGLang and vLLM do for GLM
and DeepSeek: after every step the MTP layer runs over the positions the step committed (its
own latent + indexer cache must cover every position), and from the last one it drafts ``k``
tokens by feeding each draft back through itself. The drafts wait on the request for the next
step, where the scheduler proposes them and the target verifies them.

Position ``p`` of the MTP layer reads the token at ``p + 1`` and the target's hidden state at
``p``, so its cache row depends on the token *after* ``p``. A prefix-cache hit ends at a page
boundary whose next token may differ from the request that wrote the page: that row is
recomputed, with the rest of its index pool (``kpool`` positions, so the pooled key is rebuilt
from fresh members rather than from a tail ring that has moved on), from the target hidden
states saved at the end of every page (``mtp_hidden`` in ``cache_spec``).
Chained drafts write the MTP layer's rows past the committed tokens (into pages the scheduler
reserved ahead, ``lookahead``); those rows are overwritten by the next step's pass, and the
MTP layer's indexer tail (per-sequence state) is put back after the chain.
"""

from __future__ import annotations

import torch

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

    def __init__(self, model, cache, num_tokens: int, index_topk: int | None, ops):
        self.model, self.cache, self.k = model, cache, num_tokens
        self.index_topk, self.ops = index_topk, ops
        spec = cache.spec
        self.page, self.kpool = spec.page_size, spec.kpool
        self.hidden_pool = cache.tensors.pools["mtp_hidden"][0]          # [pages * kpool, H]
        self.state_rows = {name: [r] for name in ("index_tail",) if spec.pool(name) is not None
                           for r in [spec.index_row(spec.mtp_layers[0])]}

    def _batch(self, tokens, starts, tables, slots) -> ForwardBatch:
        return ForwardBatch.build(tokens, starts, tables, slots, self.cache.tensors, self.index_topk, ops=self.ops)

    def run(self, seqs, starts: list[int], tables, slots, cu: list[int], hidden: torch.Tensor, results) -> None:
        """After a step's forward (and any rollback): ``hidden`` holds the target's rows of every
        scheduled token (sequence ``b`` from ``cu[b]``); ``results`` what each sequence gained."""
        toks, st, rows, redo_pages, last = [], [], [], [], []
        saved_rows, saved_at = [], []
        gained_of = []
        for b, s in enumerate(seqs):
            req, c = s.req, starts[b]
            res = results[b]
            gained = res.tokens if res.tokens is not None else [] if res.token is None else [res.token]
            gained_of.append(gained)
            m = s.num_known + (len(gained) - 1 if s.draft else 0)
            known = req.all_token_ids
            nxt = (known[c + 1: c + s.num_known] + gained) if gained else known[c + 1: c + s.num_known + 1]
            m = min(m, len(nxt))
            redo = c > 0 and req.mtp_position != c
            if redo and c % self.page:
                raise RuntimeError(f"request {req.request_id}: the MTP cache ends at {req.mtp_position}, the "
                                   f"step starts at {c}, which is not a page boundary")
            toks.append((known[c - self.kpool + 1: c + 1] if redo else []) + nxt[:m])
            st.append(c - self.kpool if redo else c)
            redo_pages.append(tables[b][(c - 1) // self.page] if redo else None)
            for j in range(m):
                rows.append(cu[b] + j)
                at_page = (c + j) % self.page - (self.page - self.kpool)
                if at_page >= 0:
                    saved_rows.append(cu[b] + j)
                    saved_at.append(tables[b][(c + j) // self.page] * self.kpool + at_page)
            req.mtp_position = c + m
            last.append(sum(len(t) for t in toks) - 1)
        parts, at = [], 0
        h_rows = hidden[torch.tensor(rows, dtype=torch.long)]
        for b, page in enumerate(redo_pages):
            n = len(toks[b]) - (0 if page is None else self.kpool)
            if page is not None:
                parts.append(self.hidden_pool[page * self.kpool: (page + 1) * self.kpool])
            parts.append(h_rows[at: at + n])
            at += n
        h_in = torch.cat(parts)
        if saved_rows:
            self.hidden_pool[torch.tensor(saved_at, dtype=torch.long)] = hidden[torch.tensor(saved_rows, dtype=torch.long)]
        out = self.model.mtp(self._batch(toks, st, tables, slots), h_in)
        self._draft(seqs, tables, slots, gained_of, out[torch.tensor(last, dtype=torch.long)])

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
                batch = self._batch([[r.draft_token_ids[-1]] for r in reqs],
                                    [r.mtp_position + step - 1 for r in reqs],
                                    [tables[b] for b in chain], [slots[b] for b in chain])
                h = self.model.mtp(batch, h)
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
