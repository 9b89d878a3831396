"""Model runner: turns a scheduled step into one ForwardBatch, runs the model, samples."""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from ..kernels.backends import KernelBackend
from ..kernels.sampling import sample, sampling_probs, topk_logprobs
from ..models.forward_batch import ForwardBatch
from ..models.state_replay import StateReplay
from ..trace_ranges import profiling_range
from .cache.manager import CacheManager
from .compiled_decode import CompiledDecode
from .scheduler import SchedulerOutput
from .speculative import MtpPass, accept_greedy, accept_sampled, accept_synthetic
from .structured_output import Grammars


@dataclass
class SeqResult:
    token: int | None = None
    tokens: list[int] | None = None     # a verified draft: the accepted drafts, then the model's next token
    logprobs: dict[int, float] | None = None
    prompt_logprobs: list[dict[int, float]] | None = None
    prompt_logprob_rows: torch.Tensor | None = None   # LLM.score: this step's full fp32 prompt rows


class ModelRunner:
    def __init__(self, model: torch.nn.Module, cache: CacheManager, seed: int = 0, index_topk: int | None = None,
                 compiled: CompiledDecode | None = None, grammars: Grammars | None = None,
                 ops: KernelBackend | None = None, mtp: MtpPass | None = None,
                 synthetic_rate: float | None = None):
        self.ops = ops                    # the kernel backend every batch carries (None: the device's default)
        self.index_topk = index_topk      # the engine's sparse-attention override (None: the config's)
        self.model = model
        self.state_replay = StateReplay(model)    # speculative rollback: stateful layers only
        self.cache = cache
        self.compiled = compiled          # static-graph decode buckets (None: always eager)
        self.generator = torch.Generator().manual_seed(seed)
        self.grammars = grammars          # masks the logits of requests with structured output
        self.last_sample_s = 0.0          # seconds the last run() spent sampling (step records)
        self.mtp = mtp                    # MTP drafting: its layer's pass after every step
        self.synthetic_rate = synthetic_rate   # benchmarks only: drafts kept at this rate, not verified

    @torch.inference_mode()
    def run(self, sched: SchedulerOutput) -> list[SeqResult]:
        seqs = sched.seqs
        if self._fits_graph(seqs):
            return self._run_compiled(seqs)
        new_tokens, starts, tables, slots = [], [], [], []
        for s in seqs:
            c = s.req.num_computed_tokens
            new_tokens.append(s.req.all_token_ids[c: c + s.num_known] + s.draft)
            starts.append(c)
            tables.append(self.cache.block_table(s.req))
            slots.append(self.cache.state_slot(s.req))
        kept = self._keep_states(seqs, slots)
        batch = ForwardBatch.build(new_tokens, starts, tables, slots, self.cache.tensors, self.index_topk,
                                   ops=self.ops)
        if kept:
            batch.record = {}
        hidden = self.model(batch)
        cu = batch.cu_q.tolist()
        results = self._timed_sample(seqs, starts, cu, hidden)
        if kept:
            self._roll_back(seqs, results, new_tokens, starts, tables, slots, kept, batch.record, cu)
        if self.mtp is not None:
            self.mtp.run(seqs, starts, tables, slots, cu, hidden, results)
        return results

    def _keep_states(self, seqs, slots: list[int]) -> dict[int, int]:
        """The state of every sequence with drafts before an eager verify step, for a rollback:
        sequence -> the row it was copied to (none for models without per-sequence state)."""
        kept = {}
        if self.cache.stateful:
            for b, s in enumerate(seqs):
                if s.draft:
                    kept[b] = self.cache.draft_row(s.req)
                    self.cache.snapshots.copy(slots[b], kept[b])
        return kept

    @staticmethod
    def _kept_tokens(seq, result: SeqResult) -> int:
        """Of a sequence's tokens in this step, how many its state must end after (the known
        ones and the accepted drafts)."""
        gained = len(result.tokens) if result.tokens is not None else int(result.token is not None)
        return seq.num_known + max(gained - 1, 0)

    def _roll_back(self, seqs, results, new_tokens, starts, tables, slots, kept: dict[int, int],
                   record: dict, cu: list[int]) -> None:
        """After an eager verify step, sequences that rejected drafts get their state back from
        before the step and advance it again over the tokens they kept, from the inputs the
        stateful layers recorded in the verify forward (``models.state_replay``): every state row
        then holds what a run without drafts would. Pages need nothing: the rows past the
        accepted tokens are simply overwritten later."""
        replay = [b for b in kept if self._kept_tokens(seqs[b], results[b]) < len(new_tokens[b])]
        if not replay:
            return
        for b in replay:
            self.cache.snapshots.copy(kept[b], slots[b])
        keep = [new_tokens[b][: self._kept_tokens(seqs[b], results[b])] for b in replay]
        rows = torch.tensor([cu[b] + j for b, k in zip(replay, keep) for j in range(len(k))], dtype=torch.long)
        batch = ForwardBatch.build(keep, [starts[b] for b in replay], [tables[b] for b in replay],
                                   [slots[b] for b in replay], self.cache.tensors, self.index_topk, ops=self.ops)
        with profiling_range("draft_rollback"):
            self.state_replay(record, rows, batch)

    def _fits_graph(self, seqs) -> bool:
        """Whether a static graph runs this step: decode sequences only (with or without drafts).
        Without per-sequence state their rows must fit the largest bucket; with it, the
        sequences must (drafts are at most ``verify_rows - 1``: a compiled verify step)."""
        if self.compiled is None or any(s.num_known != 1 for s in seqs):
            return False
        if not any(s.draft for s in seqs):
            return len(seqs) <= self.compiled.max_size
        if not self.cache.stateful:
            return sum(s.num_new for s in seqs) <= self.compiled.max_size
        return (self.compiled.verify_rows > 1 and len(seqs) <= self.compiled.max_size
                and all(s.num_new <= self.compiled.verify_rows for s in seqs))

    def _run_compiled(self, seqs) -> list[SeqResult]:
        """One padded batch through the static graphs.

        Without per-sequence state, a sequence with drafts takes one decode row per verified
        token (``CompiledDecode.batch_rows``: causal attention over the drafts in the graphs
        compiled for decode). With per-sequence state (KDA, pooled indexer tails) the state must
        advance token by token: a verify batch of ``verify_rows`` tokens per sequence runs the
        graphs compiled for it, a sequence with fewer drafts (a page boundary, its output limit)
        padded with token 0 at the following positions (their rows land on the null page or are
        overwritten later), and every sequence whose kept tokens end before its rows do gets the
        state the step left after its last kept token copied back into its slot
        (``StepStates``): no replay."""
        starts = [s.req.num_computed_tokens for s in seqs]
        tables = [self.cache.block_table(s.req) for s in seqs]
        slots = [self.cache.state_slot(s.req) for s in seqs]
        tokens = [[s.req.all_token_ids[c]] + s.draft for s, c in zip(seqs, starts)]
        q = self.compiled.verify_rows if self.cache.stateful and any(s.draft for s in seqs) else 1
        if q > 1:
            tokens = [t + [0] * (q - len(t)) for t in tokens]
            cu = [b * q for b in range(len(seqs) + 1)]
            hidden = self.compiled.run(self.compiled.batch_verify(tokens, starts, tables, slots))
        else:
            cu = [0]
            for t in tokens:
                cu.append(cu[-1] + len(t))
            hidden = self.compiled.run(self.compiled.batch_rows(tokens, starts, tables, slots))
        results = self._timed_sample(seqs, starts, cu, hidden)
        if q > 1:
            kept = [self._kept_tokens(s, r) for s, r in zip(seqs, results)]
            short = [b for b, n in enumerate(kept) if n < q]
            if short:
                with profiling_range("draft_rollback"):
                    self.compiled.step_states.restore(short, [kept[b] for b in short], [slots[b] for b in short])
        if self.mtp is not None:
            self.mtp.run(seqs, starts, tables, slots, cu, hidden, results)
        return results

    def _timed_sample(self, seqs, starts: list[int], cu: list[int], hidden: torch.Tensor) -> list[SeqResult]:
        t0 = time.monotonic()
        with profiling_range("sampling"):
            out = self._sample(seqs, starts, cu, hidden)
        self.last_sample_s = time.monotonic() - t0
        return out

    def _verify(self, req, draft: list[int], logits: torch.Tensor) -> list[int]:
        """The tokens a request gains from its verified drafts (``logits``: 1 + drafts rows)."""
        p = req.params
        generator = req.generator if req.generator is not None else self.generator
        if p.greedy and self.synthetic_rate is None:
            return accept_greedy(draft, logits.argmax(dim=-1).tolist())
        n = logits.shape[0]
        if p.greedy:
            target = logits.argmax(dim=-1).tolist()
        else:
            probs = sampling_probs(logits, torch.full((n,), float(p.temperature)), torch.full((n,), p.top_k),
                                   torch.full((n,), float(p.top_p)), torch.full((n,), float(p.min_p)))
            uniforms = torch.rand((n, 2), generator=generator)
            if self.synthetic_rate is None:
                return accept_sampled(probs, draft, uniforms)
            target = [accept_sampled(probs[i: i + 1], [], uniforms[i: i + 1])[0] for i in range(n)]
        return accept_synthetic(draft, target, self.synthetic_rate, torch.rand(n - 1, generator=generator))

    def _sample(self, seqs, starts: list[int], cu: list[int], hidden: torch.Tensor) -> list[SeqResult]:
        # rows whose logits we need: the last token of sampling sequences, and prompt positions
        # of requests that asked for prompt logprobs
        rows: list[int] = []
        sample_row: dict[int, int] = {}
        verify_rows: dict[int, int] = {}          # a sequence with drafts: its first row (1 + drafts rows)
        prompt_rows: dict[int, tuple[int, list[int]]] = {}
        for b, s in enumerate(seqs):
            req, end = s.req, cu[b] + s.num_new      # (a padded verify batch has rows past ``end``)
            if req.prompt_logprobs is not None and len(req.prompt_logprobs) < req.num_prompt_tokens:
                # logits at position p score prompt token p + 1
                first = len(req.prompt_logprobs) - 1
                last = min(starts[b] + s.num_new, req.num_prompt_tokens - 1)
                positions = list(range(max(first, starts[b]), last))
                if positions:
                    prompt_rows[b] = (len(rows), positions)
                    rows.extend(cu[b] + p - starts[b] for p in positions)
            if s.draft:
                verify_rows[b] = len(rows)
                rows.extend(range(end - 1 - len(s.draft), end))
            elif s.samples:
                sample_row[b] = len(rows)
                rows.append(end - 1)
        results = [SeqResult() for _ in seqs]
        if not rows:
            return results
        logits = self.model.compute_logits(hidden[torch.tensor(rows, dtype=torch.long)]).float()
        # log-probs over the vocabulary only when a request asked for them (plain and verify steps skip it)
        wants_logprobs = prompt_rows or any(seqs[b].req.params.logprobs is not None for b in sample_row)
        logprobs = torch.log_softmax(logits, dim=-1) if wants_logprobs else None
        for b, at in verify_rows.items():
            results[b].tokens = self._verify(seqs[b].req, seqs[b].draft, logits[at: at + len(seqs[b].draft) + 1])

        for b, (at, positions) in prompt_rows.items():
            req = seqs[b].req
            targets = torch.tensor([req.prompt_token_ids[p + 1] for p in positions])
            results[b].prompt_logprobs = topk_logprobs(
                logprobs[at: at + len(positions)], targets, req.params.prompt_logprobs)
            if req.prompt_logprob_rows is not None:
                results[b].prompt_logprob_rows = logprobs[at: at + len(positions)].clone()

        if sample_row:
            bs = list(sample_row)
            idx = torch.tensor([sample_row[b] for b in bs], dtype=torch.long)
            params = [seqs[b].req.params for b in bs]
            # one batched draw; only seeded requests draw from their own generator
            uniforms = torch.rand(len(bs), generator=self.generator)
            for j, b in enumerate(bs):
                if seqs[b].req.generator is not None:
                    uniforms[j] = torch.rand((), generator=seqs[b].req.generator)
            # a plain step samples every row, in order: no copy of the logits
            rows = logits if len(bs) == logits.shape[0] else logits[idx]
            grammars = [seqs[b].req.grammar for b in bs]
            if any(g is not None for g in grammars):
                self.grammars.mask(rows, grammars)   # logprobs stay the model's own (vLLM's default)
            tokens = sample(
                rows,
                torch.tensor([p.temperature for p in params], dtype=torch.float32),
                torch.tensor([p.top_k for p in params], dtype=torch.long),
                torch.tensor([p.top_p for p in params], dtype=torch.float32),
                torch.tensor([p.min_p for p in params], dtype=torch.float32),
                uniforms,
                argmax=None if self.ops is None else self.ops.greedy,
            )
            token_list = tokens.tolist()
            for j, b in enumerate(bs):
                results[b].token = token_list[j]
                k = params[j].logprobs
                if k is not None:
                    results[b].logprobs = topk_logprobs(logprobs[idx[j]: idx[j] + 1], tokens[j: j + 1], k)[0]
        return results
