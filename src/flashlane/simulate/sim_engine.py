"""The engine in simulated time: the real scheduler and cache manager, the model replaced by a
step-cost model.

``SimEngine`` builds the same ``CacheManager`` (prefix cache, state checkpoints, preemption) and
the same ``Scheduler`` / ``StaticScheduler`` as ``LLMEngine`` from the same engine arguments, so
scheduling policy cannot drift from the engine's. The cache's tensors live on torch's ``meta``
device: pages, slots and checkpoints are accounted for exactly, nothing is allocated, so a
full-size model with a multi-GB cache can be simulated on a laptop. A step's duration is
``cost(StepShape)``; its sampled tokens are a filler id (the simulator has no logits, so requests
end by their length limit, as ``bench`` replays ask with ``ignore_eos``).

Static-graph decode and quantisation change what a step costs, not what is scheduled: they are
the step-cost model's business (a calibration records the mode it was fitted in). Not modelled:
host and disk cache tiers (refused), structured output, stop strings.

Speculative decoding with the MTP drafter, at a given mean acceptance length (the engine's
synthetic acceptance: each draft kept with the same probability until the first miss; the
simulator has no logits to verify against): the real scheduler proposes the drafts the previous
step's MTP pass left, exactly as in the engine, and the pass itself is composed as ``MtpPass``
composes it (its catch-up over the committed tokens, one more row where a prefix hit left the
MTP layer's cache behind, then chained drafts while the output limit and the pages reserved
ahead allow), so a step's verify rows and its MTP layer's calls and rows are priced by the
step-cost model. n-gram drafts depend on the text, which the simulator does not have: refused.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..analyze.step_cost import StepShape
from ..cache_spec import cache_spec
from ..config import ModelConfig
from ..engine.cache.manager import CacheManager, plan_cache
from ..engine.engine_args import EngineArgs
from ..engine.request import Request
from ..engine.runner import SeqResult
from ..engine.sampling_params import SamplingParams
from ..engine.scheduler import SchedulerOutput
from ..engine.scheduler_choice import build_scheduler, max_running_seqs

FILLER_TOKEN = 1
DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}


@dataclass(frozen=True)
class SimStep:
    """One simulated step: when it ran, what it computed (the engine's step-record fields)."""
    step: int
    start: float
    end: float
    request_ids: tuple[str, ...]
    seq_new_tokens: tuple[int, ...]
    seq_cached_tokens: tuple[int, ...]
    num_preempted: int
    num_running: int
    num_waiting: int
    finished: tuple[str, ...]        # requests this step ended
    sampled: tuple[str, ...] = ()    # requests that got a token from this step (decodes, last prefill chunks)
    sampled_tokens: tuple[int, ...] = ()    # tokens each of ``sampled`` got (more than 1: accepted drafts)
    seq_draft_tokens: tuple[int, ...] = ()  # per scheduled sequence: drafts it verified
    draft_calls: int = 0                    # the MTP drafter's pass after the step
    draft_rows: int = 0
    draft_logit_rows: int = 0

    @property
    def duration(self) -> float:
        return self.end - self.start


class SimEngine:
    def __init__(self, cfg: ModelConfig, cost: Callable[[StepShape], float], dtype: str = "bfloat16",
                 **engine_args):
        unsupported = [k for k in ("host_cache_memory", "disk_cache_dir") if engine_args.get(k)]
        if unsupported:
            raise ValueError(f"simulate does not model {', '.join(unsupported)} yet (host and disk cache "
                             "tiers are not simulated)")
        if dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
        args = EngineArgs.from_kwargs(**{"dtype": dtype, **engine_args})
        args.validate()
        self.args, self.cfg, self.cost = args, cfg, cost
        self.speculative = args.speculative()
        self._accept = random.Random(args.seed)     # synthetic acceptance draws
        if self.speculative is not None:
            self._check_speculative(cfg)
        mtp = self.speculative is not None
        spec = cache_spec(cfg, args.page_size, args.kv_cache_dtype, mtp=mtp)
        prefix = args.enable_prefix_caching
        plan = plan_cache(spec, DTYPES[dtype], args.cache_memory, args.max_num_seqs, args.num_pages, args.num_slots,
                          "cpu", checkpoint_share=args.checkpoint_share if prefix else 0.0,
                          num_checkpoints=args.num_checkpoints if prefix else 0, draft_rollback=mtp)
        self.cache = CacheManager(spec, plan, DTYPES[dtype], "meta", prefix, f"simulated|{cfg.arch}|{dtype}")
        self.plan = plan
        running = max_running_seqs(args, spec, plan)
        self.max_model_len = min(args.max_model_len or cfg.max_position_embeddings, plan.num_tokens)
        self.scheduler = build_scheduler(args, cfg, self.cache, running)
        self.now = 0.0
        self.wake_at: float | None = None     # when a held admission window opens (after an empty step)
        self.requests: dict[str, Request] = {}
        self._steps = 0

    def _check_speculative(self, cfg: ModelConfig) -> None:
        s = self.speculative
        if s.method != "mtp":
            raise ValueError(f"simulate does not model speculative_config.method {s.method!r}: n-gram drafts come "
                             "from the text, which the simulated server does not generate (use 'mtp')")
        if not s.synthetic:
            raise ValueError("simulate needs speculative_config.rejection_sample_method 'synthetic' with a "
                             "synthetic_acceptance_length: the simulated server has no logits to verify drafts "
                             "against, so the mean acceptance length is an assumption it must be given")
        if not cfg.num_mtp_layers or cfg.arch == "llama":
            raise ValueError(f"speculative_config.method 'mtp' needs the model's MTP layer: {cfg.arch} has none")
        self._rate = s.synthetic_rate

    def add_request(self, request_id: str, prompt_ids: list[int], max_tokens: int,
                    arrival: float | None = None) -> Request:
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        if not prompt_ids or len(prompt_ids) + max_tokens > self.max_model_len:
            raise ValueError(f"request {request_id}: {len(prompt_ids)} prompt + {max_tokens} output tokens do not "
                             f"fit the simulated context of {self.max_model_len}")
        req = Request(request_id, prompt_ids, SamplingParams(max_tokens=max_tokens, ignore_eos=True), (),
                      self.now if arrival is None else arrival, max_tokens)
        self.requests[request_id] = req
        self.scheduler.add(req)
        return req

    def abort(self, request_id: str) -> None:
        """End a request that has not finished (its client went away); nothing if it has."""
        req = self.requests.pop(request_id, None)
        if req is not None and not req.finished:
            self.scheduler.finish(req, "abort", None)

    @property
    def has_work(self) -> bool:
        return self.scheduler.has_work

    def step(self) -> SimStep | None:
        """Schedule and 'run' one step at the simulated time ``now``; None when nothing could be
        scheduled (the caller advances ``now`` to its next arrival or to ``wake_at``)."""
        sched: SchedulerOutput = self.scheduler.schedule(self.now)
        if sched.empty:
            self.wake_at = sched.wake_at
            return None
        cached = tuple(s.req.num_computed_tokens for s in sched.seqs)
        new = tuple(s.num_new for s in sched.seqs)
        drafts = tuple(len(s.draft) for s in sched.seqs)
        results = [self._result(s) for s in sched.seqs]
        calls, rows, logit_rows = self._draft_pass(sched.seqs, results) if self.speculative else (0, 0, 0)
        shape = StepShape(prefill=tuple((n, c) for n, c, d in zip(new, cached, drafts) if n > 1 and not d),
                          decode=tuple(c for n, c in zip(new, cached) if n == 1),
                          verify=tuple((d, c) for c, d in zip(cached, drafts) if d),
                          draft_calls=calls, draft_rows=rows, draft_logit_rows=logit_rows)
        start = self.now
        self.now += self.cost(shape)
        before = {s.req.request_id: len(s.req.output_token_ids) for s in sched.seqs}
        progress = self.scheduler.update_from_output(sched, results)
        sampled = tuple((req.request_id, len(req.output_token_ids) - before[req.request_id])
                        for req, _ in progress.sampled)
        finished = tuple(s.req.request_id for s in sched.seqs if s.req.finished)
        for rid in finished:
            del self.requests[rid]
        self._steps += 1
        return SimStep(self._steps, start, self.now, tuple(s.req.request_id for s in sched.seqs), new, cached,
                       len(sched.preempted), len(self.scheduler.running), self.scheduler.num_waiting, finished,
                       tuple(r for r, _ in sampled), tuple(n for _, n in sampled), drafts, calls, rows, logit_rows)

    def _result(self, s) -> SeqResult:
        """A sequence's filler token; with drafts, the accepted ones and the bonus token."""
        if not s.draft:
            return SeqResult(token=FILLER_TOKEN if s.samples else None)
        accepted = 0
        while accepted < len(s.draft) and self._accept.random() < self._rate:
            accepted += 1
        return SeqResult(tokens=s.draft[:accepted] + [FILLER_TOKEN])

    def _draft_pass(self, seqs, results) -> tuple[int, int, int]:
        """The MTP pass after the step, as ``MtpPass.run`` composes it: (its layer's calls, its rows,
        the rows drafted from). Leaves each request's drafts for the next step."""
        page, k = self.cache.page_size, self.speculative.num_speculative_tokens
        rows, chains = 0, []
        for s, res in zip(seqs, results):
            req, c = s.req, s.req.num_computed_tokens
            gained = res.tokens if res.tokens is not None else [] if res.token is None else [res.token]
            m = s.num_known + (len(gained) - 1 if s.draft else 0)
            redo = c > 0 and req.mtp_position != c
            req.draft_token_ids = []
            if m == 0 and not redo:
                continue
            rows += m + redo
            req.mtp_position = c + m
            left = req.max_tokens - len(req.output_token_ids) - len(gained) - 1
            want = min(k, left) if gained and req.params.logprobs is None else 0
            if want > 0:
                room = min(want, len(self.cache.block_table(req)) * page - req.mtp_position + 1)
                chains.append(max(1, room))
                req.draft_token_ids = [FILLER_TOKEN] * max(1, room)
        calls = (1 if rows else 0) + (max(chains) - 1 if chains else 0)
        chained = sum(d - 1 for d in chains)
        return calls, rows + chained, len(chains) + chained
