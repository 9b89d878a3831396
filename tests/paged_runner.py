"""Drive a flashlane model through its paged cache the way an engine does (test helper).

Each sequence gets its own (deliberately scattered) pages and state slot; prefill may be split
into chunks, and every call packs all live sequences into one ForwardBatch.
"""

from __future__ import annotations

import torch

from flashlane.cache_spec import cache_spec
from flashlane.engine.cache.pools import allocate_pools
from flashlane.engine.cache.snapshots import StateSnapshots
from flashlane.models.forward_batch import ForwardBatch


class PagedRunner:
    def __init__(self, model, cfg, page_size: int = 16, max_tokens: int = 1024, max_seqs: int = 8,
                 dtype: torch.dtype = torch.float32, seed: int = 0, kv_cache_dtype: str = "auto", ops=None):
        self.model, self.cfg, self.ops = model, cfg, ops
        self.spec = cache_spec(cfg, page_size, kv_cache_dtype)
        self.pages_per_seq = -(-max_tokens // page_size)
        num_pages = 1 + self.pages_per_seq * max_seqs
        self.cache = allocate_pools(self.spec, num_pages, max_seqs + 1, dtype)
        order = torch.randperm(num_pages - 1, generator=torch.Generator().manual_seed(seed)) + 1
        self.tables = [order[i * self.pages_per_seq:(i + 1) * self.pages_per_seq].tolist()
                       for i in range(max_seqs)]

    def _step(self, seqs: list[int], new: list[list[int]], starts: list[int]) -> torch.Tensor:
        batch = ForwardBatch.build(new, starts, [self.tables[s] for s in seqs],
                                   [s + 1 if self.spec.needs_state_slot else 0 for s in seqs], self.cache,
                                   ops=self.ops)
        with torch.no_grad():
            return self.model.compute_logits(self.model(batch)).float()

    def _clear(self, seqs) -> None:
        snapshots = StateSnapshots(self.cache)
        for s in seqs:
            snapshots.clear(s + 1)

    def prefill(self, prompts: list[list[int]], chunk: int | None = None) -> list[torch.Tensor]:
        """Log-probs [L, V] at every prompt position; all sequences advance together per call."""
        self._clear(range(len(prompts)))
        done = [0] * len(prompts)
        out: list[list[torch.Tensor]] = [[] for _ in prompts]
        while any(d < len(p) for d, p in zip(done, prompts)):
            seqs = [s for s, p in enumerate(prompts) if done[s] < len(p)]
            new = [prompts[s][done[s]:done[s] + (chunk or len(prompts[s]))] for s in seqs]
            logits = self._step(seqs, new, [done[s] for s in seqs])
            at = 0
            for s, toks in zip(seqs, new):
                out[s].append(torch.log_softmax(logits[at:at + len(toks)], -1))
                at += len(toks)
                done[s] += len(toks)
        return [torch.cat(o) for o in out]

    def greedy(self, prompts: list[list[int]], steps: int, chunk: int | None = None) -> list[list[int]]:
        """Prefill, then ``steps`` batched single-token decode calls; returns the new tokens."""
        lp = self.prefill(prompts, chunk)
        gen = [[int(x[-1].argmax())] for x in lp]
        lens = [len(p) for p in prompts]
        for _ in range(steps - 1):
            seqs = list(range(len(prompts)))
            logits = self._step(seqs, [[g[-1]] for g in gen], [lens[s] + len(gen[s]) - 1 for s in seqs])
            for s in seqs:
                gen[s].append(int(logits[s].argmax()))
        return gen

    def mixed(self, first: list[int], second: list[int], decode_steps: int) -> tuple[list[int], torch.Tensor]:
        """Sequence 0 decodes while sequence 1 prefills in the same calls (chunk = decode_steps
        pieces of ``second``); returns seq 0's greedy tokens and seq 1's prompt log-probs."""
        lp0 = self.prefill([first])[0]
        self._clear([1])
        gen = [int(lp0[-1].argmax())]
        piece = -(-len(second) // decode_steps)
        done, lp1 = 0, []
        for _ in range(decode_steps):
            new = [[gen[-1]]]
            starts = [len(first) + len(gen) - 1]
            seqs = [0]
            if done < len(second):
                new.append(second[done:done + piece])
                starts.append(done)
                seqs.append(1)
            logits = self._step(seqs, new, starts)
            gen.append(int(logits[0].argmax()))
            if len(seqs) > 1:
                lp1.append(torch.log_softmax(logits[1:], -1))
                done += len(new[1])
        return gen, torch.cat(lp1)
