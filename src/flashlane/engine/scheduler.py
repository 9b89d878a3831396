"""Continuous batching: every step packs decode tokens of running requests and prefill chunks
of waiting ones under a token budget (``max_num_batched_tokens``) and a running bound
(``max_num_seqs``). Admission needs pages AND a state slot. When pages run out mid-decode the
most recently admitted request is preempted by recompute: it frees everything and goes back to
the front of the queue, keeping its generated tokens, so it finishes with the same output.
Admission first asks the cache for the request's longest reusable prefix (prefix cache): a hit
starts the request's prefill after it, and prefills pause at checkpoint stops so hybrid models
get their state checkpointed where the next turn will start. The scheduler alone writes a
request's progress, from what the cache manager (``admit``) and the runner (its results) return;
what a request holds in the cache the cache manager keeps itself.

Length-aware packing: a long prompt never blocks a step — it is cut into chunks (multiples of
lcm(page_size, kpool, 64)) that share the step with everybody's decode tokens, so a batch never
waits for its longest member (the fixed-batch imbalance). The dynamic batching window
(``max_wait_ms``) holds prefill admission briefly while the waiting prompts do not yet fill the
budget, trading a little TTFT for fuller prefill batches. Static batching, the naive baseline,
is ``StaticScheduler`` (static_scheduler.py): this scheduler restricted to one batch at a time.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass, field

from .cache.manager import CacheManager
from .request import Request, Status

log = logging.getLogger("flashlane.engine")


@dataclass
class ScheduledSeq:
    req: Request
    num_new: int            # tokens computed this step, from req.num_computed_tokens on (drafts included)
    draft: list[int] = field(default_factory=list)   # speculative tokens after the last known one

    @property
    def num_known(self) -> int:
        """Tokens of the request's own computed this step (``num_new`` less the drafts)."""
        return self.num_new - len(self.draft)

    @property
    def samples(self) -> bool:
        """True when this chunk reaches the last known token, so a next token is sampled."""
        return self.req.num_computed_tokens + self.num_known == self.req.num_tokens


@dataclass
class SchedulerOutput:
    seqs: list[ScheduledSeq] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    wake_at: float | None = None   # when a held admission window expires (nothing else to do)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new for s in self.seqs)

    @property
    def empty(self) -> bool:
        return not self.seqs


@dataclass
class StepProgress:
    """What a finished step did to the scheduled requests (see ``Scheduler.update_from_output``)."""
    sampled: list[tuple[Request, int]] = field(default_factory=list)  # (request, tokens it gained this step)
    prefill_tokens: int = 0
    decode_seqs: int = 0
    drafted: int = 0                                          # draft tokens verified this step
    accepted: list[int] = field(default_factory=list)         # per verified sequence: drafts accepted


class Scheduler:
    def __init__(self, cache: CacheManager, max_num_seqs: int, max_num_batched_tokens: int,
                 chunk_multiple: int, max_wait_ms: float = 0.0, drafter=None):
        if max_num_batched_tokens < chunk_multiple:
            raise ValueError(f"max_num_batched_tokens ({max_num_batched_tokens}) must be >= the prefill "
                             f"chunk granularity ({chunk_multiple})")
        self.cache = cache
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.chunk_multiple = chunk_multiple
        self.max_wait_s = max_wait_ms / 1000.0
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self._admissions = 0
        self.num_preemptions = 0
        self.drafter = drafter         # speculative decoding: proposes draft tokens for decoding requests

    # ---- queue management -------------------------------------------------------------------
    def add(self, req: Request) -> None:
        self.waiting.append(req)

    def remove(self, req: Request) -> None:
        """Drop a request wherever it is and give its memory back at once."""
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        self.cache.release(req)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def num_waiting(self) -> int:
        """Requests not running: queued for admission (or preempted)."""
        return len(self.waiting)

    # ---- one step ---------------------------------------------------------------------------
    def _chunk(self, req: Request, start: int, budget: int) -> int:
        """Tokens of ``req`` to compute from ``start``: all that remain if they fit the budget,
        else a multiple of the chunk granularity; never past the next checkpoint stop."""
        remaining = req.num_tokens - start
        n = remaining if remaining <= budget else budget // self.chunk_multiple * self.chunk_multiple
        stop = next((p for p in self.cache.checkpoint_stops(req) if p > start), None)
        if stop is not None and start + n > stop:
            n = stop - start
        return n

    def _preempt(self, victim: Request, out: SchedulerOutput) -> None:
        self.running.remove(victim)
        self.cache.preempt(victim)
        victim.num_computed_tokens = 0
        victim.status = Status.WAITING
        victim.metrics.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(victim)
        out.preempted.append(victim)

    def schedule(self, now: float | None = None) -> SchedulerOutput:
        now = time.monotonic() if now is None else now
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        scheduled: set[int] = set()
        for req in sorted(self.running, key=lambda r: r.admitted_at):
            if req not in self.running:       # preempted earlier in this loop
                continue
            n = self._chunk(req, req.num_computed_tokens, budget)
            if n <= 0:
                continue
            draft = self._draft(req, budget) if n == 1 and self.drafter is not None else []
            if draft and not self.cache.can_admit(req, req.num_computed_tokens + 1 + len(draft)):
                draft = []             # drafts never cost another request its place
            n += len(draft)
            target = req.num_computed_tokens + n
            while not self.cache.can_admit(req, target):
                victims = [r for r in self.running if r is not req and id(r) not in scheduled]
                victim = max(victims or [req], key=lambda r: r.admitted_at)
                self._preempt(victim, out)
                if victim is req:
                    break
            if req not in self.running:
                continue
            self.cache.grow(req, self._ahead(req, target))
            out.seqs.append(ScheduledSeq(req, n, draft))
            scheduled.add(id(req))
            budget -= n
        if out.preempted or not self.waiting:
            return out
        if self._hold_admission(now, budget):
            if out.empty:
                out.wake_at = self.waiting[0].metrics.arrival_time + self.max_wait_s
            return out
        loading: list[Request] = []
        while self.waiting and len(self.running) < self.max_num_seqs and budget > 0:
            req = self.waiting.popleft()
            match = self.cache.match(req)
            if self.cache.tiers is not None and self.cache.needs_load(match, req):
                loading.append(req)          # its hit is being read from disk: let others go first
                continue
            n = self._chunk(req, match.num_tokens, budget)
            if n <= 0 or not self.cache.can_admit(req, match.num_tokens + n, match):
                self.waiting.appendleft(req)
                break
            admission = self.cache.admit(req, match, match.num_tokens + n)
            self.cache.grow(req, self._ahead(req, match.num_tokens + n))
            req.num_computed_tokens = admission.num_computed_tokens
            if admission.num_cached_tokens is not None:
                req.num_cached_tokens = admission.num_cached_tokens
            req.status = Status.RUNNING
            self._admissions += 1
            req.admitted_at = self._admissions
            if req.metrics.first_scheduled_time is None:
                req.metrics.first_scheduled_time = now
            self.running.append(req)
            out.seqs.append(ScheduledSeq(req, n))
            budget -= n
        self.waiting.extendleft(reversed(loading))
        if loading and out.empty:
            out.wake_at = now + 0.002
        return out

    def _ahead(self, req: Request, target: int) -> int:
        """``target`` plus the pages an MTP drafter writes ahead when this step samples (its chained
        drafts), when they are free; drafts never cost another request its place."""
        ahead = self.drafter.lookahead if self.drafter is not None else 0
        if ahead and target >= req.num_tokens and self.cache.can_admit(req, target + ahead):
            return target + ahead
        return target

    def _draft(self, req: Request, budget: int) -> list[int]:
        """Draft tokens for a decoding ``req`` that can take them (no logprobs, no grammar),
        never past its output limit and, for models whose state is checkpointed at page
        boundaries, never past the next boundary (so an accepted run cannot jump over it)."""
        p = req.params
        if (not req.output_token_ids or req.num_computed_tokens != req.num_tokens - 1
                or p.logprobs is not None or req.grammar is not None):
            return []
        limit = min(req.max_tokens - len(req.output_token_ids) - 1, budget - 1)
        if self.cache.checkpoints_decode:
            page = self.cache.page_size
            limit = min(limit, (req.num_computed_tokens // page + 1) * page - req.num_computed_tokens - 1)
        return self.drafter.draft(req, limit) if limit > 0 else []

    # ---- after a step ---------------------------------------------------------------------------
    def update_from_output(self, sched: SchedulerOutput, results) -> StepProgress:
        """Advance every scheduled request past the tokens the step computed (their cache rows
        are committed: full pages registered, checkpoints taken), append the tokens sampled and
        finish the requests they end. ``results``: the runner's per-sequence results,
        in ``sched.seqs`` order."""
        progress = StepProgress()
        for s, res in zip(sched.seqs, results):
            req = s.req
            prefill = s.num_known > 1 or not req.output_token_ids
            if prefill:
                progress.prefill_tokens += s.num_new
            else:
                progress.decode_seqs += 1
            before = req.num_computed_tokens
            gained = res.tokens if res.tokens is not None else [] if res.token is None else [res.token]
            if s.draft:
                accepted = len(gained) - 1
                progress.drafted += len(s.draft)
                progress.accepted.append(accepted)
                req.metrics.num_draft_tokens += len(s.draft)
                req.metrics.num_accepted_tokens += accepted
            ending, n = None, 0
            for token in gained:
                ending = self._append(req, token, res.logprobs)
                n += 1
                if ending:
                    break
            # the drafts the model agreed with are computed too (a rejected draft's rows were rolled
            # back); committed before a finish releases the request, so its last pages are registered
            req.num_computed_tokens += s.num_known + (min(len(gained) - 1, n) if s.draft else 0)
            self.cache.commit(req, before, prefill)
            if res.prompt_logprobs:
                req.prompt_logprobs.extend(res.prompt_logprobs)
            if res.prompt_logprob_rows is not None:
                req.prompt_logprob_rows.append(res.prompt_logprob_rows)
            if n:
                progress.sampled.append((req, n))
            if ending:
                self.finish(req, *ending)
        return progress

    def _append(self, req: Request, token: int, logprobs) -> tuple[str, int | None] | None:
        """``token`` joins ``req``'s output; returns the finish it causes, (reason, stop token), if
        any: a stop token, a complete structured output or the length limit (stop strings are the
        client's: they need text)."""
        req.output_token_ids.append(token)
        if req.logprobs is not None:
            req.logprobs.append(logprobs)
        if req.grammar is not None and not req.grammar.accept(token):  # the mask allowed it: a bug if seen
            log.error("request %s: token %d breaks its structured output: %s", req.request_id, token,
                      req.grammar.error)
        if token in req.stop_token_ids:
            return "stop", token
        if req.grammar is not None and req.grammar.finished:
            return "stop", None
        if len(req.output_token_ids) >= req.max_tokens:
            return "length", None
        return None

    def finish(self, req: Request, reason: str, stop_reason: int | None) -> None:
        """End ``req`` (also an abort, ``reason`` "abort", or a client's stop string, "stop"):
        it leaves the queues and its cache holdings are released."""
        if req.status is not Status.FINISHED:
            self.remove(req)
        req.status = Status.FINISHED
        req.finish_reason = reason
        req.stop_reason = stop_reason

    def _hold_admission(self, now: float, budget: int) -> bool:
        if self.max_wait_s <= 0:
            return False
        oldest = self.waiting[0].metrics.arrival_time
        if now - oldest >= self.max_wait_s:
            return False
        pending = sum(r.num_tokens - r.num_computed_tokens for r in self.waiting)
        free_seats = self.max_num_seqs - len(self.running)
        return pending < budget and len(self.waiting) < free_seats
