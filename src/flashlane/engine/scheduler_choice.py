"""The scheduler an engine runs, from its arguments: one place for ``LLMEngine`` and the simulator
(``simulate.SimEngine``), so the simulated scheduling policy is the engine's."""

from __future__ import annotations

from ..cache_spec import CacheSpec, chunk_multiple
from ..config import ModelConfig
from .cache.manager import CacheManager, CachePlan
from .engine_args import EngineArgs
from .scheduler import Scheduler
from .speculative import MtpDrafter, NgramDrafter
from .static_scheduler import StaticScheduler


def max_running_seqs(args: EngineArgs, spec: CacheSpec, plan: CachePlan) -> int:
    """Sequences that can run at once: the engine limit, the state slots (stateful models) and the pages."""
    return min(args.max_num_seqs, plan.num_slots if spec.needs_state_slot else args.max_num_seqs, plan.num_pages)


def build_scheduler(args: EngineArgs, cfg: ModelConfig, cache: CacheManager, running: int) -> Scheduler:
    granularity = chunk_multiple(cfg, args.page_size)
    if args.scheduler == "static":
        sched = StaticScheduler(cache, running, args.max_num_batched_tokens, granularity, args.static_batch_size)
    else:
        sched = Scheduler(cache, running, args.max_num_batched_tokens, granularity, args.max_wait_ms)
    spec = args.speculative()
    if spec is not None and spec.method == "mtp":
        sched.drafter = MtpDrafter(spec.num_speculative_tokens)
    elif spec is not None:
        sched.drafter = NgramDrafter(spec.num_speculative_tokens, spec.prompt_lookup_min, spec.prompt_lookup_max)
    return sched
