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
"""

from __future__ import annotations

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
        if engine_args.get("speculative_config"):
            raise ValueError("simulate does not model speculative_config yet (the simulated server generates "
                             "no text, so drafts have nothing to be accepted against)")
        if dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
        args = EngineArgs.from_kwargs(**{"dtype": dtype, **engine_args})
        args.validate()
        self.args, self.cfg, self.cost = args, cfg, cost
        spec = cache_spec(cfg, args.page_size, args.kv_cache_dtype)
        prefix = args.enable_prefix_caching
        plan = plan_cache(spec, DTYPES[dtype], args.cache_memory, args.max_num_seqs, args.num_pages, args.num_slots,
                          "cpu", checkpoint_share=args.checkpoint_share if prefix else 0.0,
                          num_checkpoints=args.num_checkpoints if prefix else 0)
        self.cache = CacheManager(spec, plan, DTYPES[dtype], "meta", prefix, f"simulated|{cfg.arch}|{dtype}")
        self.plan = plan
        running = max_running_seqs(args, spec, plan)
        self.max_model_len = min(args.max_model_len or cfg.max_position_embeddings, plan.num_tokens)
        self.scheduler = build_scheduler(args, cfg, self.cache, running)
        self.now = 0.0
        self.wake_at: float | None = None     # when a held admission window opens (after an empty step)
        self.requests: dict[str, Request] = {}
        self._steps = 0

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
        shape = StepShape(prefill=tuple((n, c) for n, c in zip(new, cached) if n > 1),
                          decode=tuple(c for n, c in zip(new, cached) if n == 1))
        start = self.now
        self.now += self.cost(shape)
        sampled = tuple(s.req.request_id for s in sched.seqs if s.samples)   # before the step advances them
        results = [SeqResult(token=FILLER_TOKEN if s.samples else None) for s in sched.seqs]
        self.scheduler.update_from_output(sched, results)
        finished = tuple(s.req.request_id for s in sched.seqs if s.req.finished)
        for rid in finished:
            del self.requests[rid]
        self._steps += 1
        return SimStep(self._steps, start, self.now, tuple(s.req.request_id for s in sched.seqs), new, cached,
                       len(sched.preempted), len(self.scheduler.running), self.scheduler.num_waiting, finished,
                       sampled)
