"""Load generation: closed loop over session trees (lanes) or open-loop arrivals, with warmup.

Closed loop (`concurrency` = N lanes): each lane replays one whole tree (root + sub-agents, so
in-flight requests can exceed N during fan-out) and draws the next as soon as it drains.
Open loop (`request_rate` = R): trees start at Poisson (burstiness 1) or gamma arrival times,
whatever is in flight; for single-turn workloads that is a request rate.

Warmup `tstar` (AgentX): each initial lane picks t* uniformly over its root timeline, sends the
root turn just before t* (with the whole accumulated prefix) as warmup; when every lane's warmup is
back, profiling starts and the lanes continue from t* (those sessions are marked truncated and
kept out of task metrics). Warmup `requests`: W single requests at concurrency N first.
A failed warmup request aborts the run.
"""

from __future__ import annotations

import asyncio
import random
from dataclasses import dataclass

from .clock import now
from .records import PHASE_PROFILING, PHASE_WARMUP, RequestRecord, SessionRecord
from .replay import (BenchAbort, Conversation, ReplayContext, TreeState, run_session, run_tree,
                     run_turn, session_record)
from .workloads.source import WorkloadSource

WARMUP_INDEX_BASE = 10_000_000  # session indices of `requests` warmup (never profiled)


@dataclass
class LoadPoint:
    concurrency: int | None = None
    request_rate: float | None = None
    burstiness: float = 1.0  # gamma shape: 1 = Poisson, < 1 burstier
    max_concurrency: int | None = None  # open loop: cap on in-flight requests

    def __post_init__(self):
        if (self.concurrency is None) == (self.request_rate is None):
            raise ValueError("load point: give exactly one of concurrency / request_rate")
        if self.concurrency is not None and self.concurrency < 1:
            raise ValueError(f"concurrency: must be >= 1, got {self.concurrency}")
        if self.request_rate is not None and not self.request_rate > 0:
            raise ValueError(f"request_rate: must be > 0, got {self.request_rate}")
        if not self.burstiness > 0:
            raise ValueError(f"burstiness: must be > 0, got {self.burstiness}")

    @property
    def label(self) -> str:
        if self.concurrency is not None:
            return f"c{self.concurrency}"
        return f"r{self.request_rate:g}"


@dataclass
class RunControl:
    num_sessions: int | None = None  # fresh trees started in profiling
    duration_s: float | None = None  # profiling window; nothing new is dispatched after it
    warmup: str = "none"  # "none" | "tstar" | "requests"
    warmup_requests: int = 0
    first_index: int = 0  # session index of the first tree (a later round of an interleaved run)

    def __post_init__(self):
        if self.first_index < 0:
            raise ValueError(f"first_index: must be >= 0, got {self.first_index}")
        if self.num_sessions is None and self.duration_s is None:
            raise ValueError("run control: give num_sessions and/or duration_s")
        if self.num_sessions is not None and self.num_sessions < 1:
            raise ValueError(f"num_sessions: must be >= 1, got {self.num_sessions}")
        if self.duration_s is not None and not self.duration_s > 0:
            raise ValueError(f"duration_s: must be > 0, got {self.duration_s}")
        if self.warmup not in ("none", "tstar", "requests"):
            raise ValueError(f"warmup: expected none/tstar/requests, got {self.warmup!r}")


@dataclass
class LoadResult:
    records: list[RequestRecord]
    sessions: list[SessionRecord]
    window_start: float
    window_end: float
    deadline: float | None
    next_index: int = 0  # the first session index this run did not use


class _Claims:
    """Hands out session indices; counts fresh trees against the limit."""

    def __init__(self, ctx: ReplayContext, limit: int | None, first: int = 0):
        self.ctx, self.limit, self.next, self.fresh = ctx, limit, first, 0

    def take_index(self) -> int:
        i = self.next
        self.next += 1
        return i

    def claim_fresh(self) -> int | None:
        if self.ctx.stopping() or (self.limit is not None and self.fresh >= self.limit):
            return None
        self.fresh += 1
        return self.take_index()

    def count_fresh(self) -> bool:
        if self.ctx.stopping() or (self.limit is not None and self.fresh >= self.limit):
            return False
        self.fresh += 1
        return True


def tstar_turn(trace, u: float) -> int:
    """Index of the first root turn at/after t* = u * (root timeline length); 0 = no truncation."""
    turns = trace.root.turns
    span = turns[-1].t - turns[0].t
    if len(turns) < 2 or span <= 0:
        return 0
    tstar = turns[0].t + u * span
    return next(k for k, tr in enumerate(turns) if tr.t >= tstar)


async def _warm_requests(ctx: ReplayContext, source: WorkloadSource, n: int, lanes: int) -> None:
    queue = list(range(n))

    async def lane(i):
        while queue:
            j = queue.pop(0)
            sr = await run_tree_first_turn(ctx, source, WARMUP_INDEX_BASE + j, i)
            if sr is not None and not sr.ok:
                raise BenchAbort(f"warmup request failed: {sr.error_class}: {sr.error_message}")

    await asyncio.gather(*(lane(i) for i in range(min(lanes, n))))


async def run_tree_first_turn(ctx, source, idx, lane) -> RequestRecord | None:
    trace = source.trace(idx)
    tree = TreeState(tree_id=f"w{idx}", trace=trace, lane=lane, phase=PHASE_WARMUP)
    turn = trace.root.turns[0]
    return await run_turn(ctx, tree, trace.root, Conversation(ctx, tree, trace.root), turn,
                          PHASE_WARMUP, now(), 0.0)


async def run_closed(ctx: ReplayContext, source: WorkloadSource, n_lanes: int,
                     control: RunControl) -> tuple[float, float | None, int]:
    claims = _Claims(ctx, control.num_sessions, control.first_index)
    rng = random.Random(f"tstar:{ctx.seed}")
    plans = []  # per lane: (idx, trace, k*, tree, conv, warm_rec)
    if control.warmup == "requests" and control.warmup_requests > 0:
        await _warm_requests(ctx, source, control.warmup_requests, n_lanes)
    if control.warmup == "tstar":
        for lane in range(n_lanes):
            idx = claims.take_index()
            trace = source.trace(idx)
            plans.append((idx, trace, tstar_turn(trace, rng.random())))

        async def warm(lane, idx, trace, k):
            tree = TreeState(tree_id=f"t{idx}", trace=trace, lane=lane, phase=PHASE_WARMUP)
            conv = Conversation(ctx, tree, trace.root)
            turns = trace.root.turns
            for tr in turns[:k - 1]:
                conv.prepare(tr)
                conv.absorb(tr, None)
            rec = await run_turn(ctx, tree, trace.root, conv, turns[k - 1], PHASE_WARMUP, now(), 0.0)
            if not rec.ok:
                raise BenchAbort(f"root warmup request {rec.request_id} failed: "
                                 f"{rec.error_class}: {rec.error_message}")
            return tree, conv, rec

        warmed = await asyncio.gather(*(warm(i, *p) for i, p in enumerate(plans) if p[2] > 0))
        warmed_iter = iter(warmed)
        plans = [(p, next(warmed_iter) if p[2] > 0 else None) for p in plans]
    start = now()
    deadline = start + control.duration_s if control.duration_s else None
    ctx.deadline = deadline

    async def lane_loop(lane: int):
        if plans:
            (idx, trace, k), warm = plans[lane]
            if warm is None:
                if claims.count_fresh():
                    await run_tree(ctx, trace, f"t{idx}", lane)
            else:
                tree, conv, wrec = warm
                tree.phase = PHASE_PROFILING
                turn_k = trace.root.turns[k]
                step_after = trace.root.steps.index(trace.root.turns[k - 1]) + 1
                tstar_t = turn_k.t  # spawns before the resumed turn belong to the cut history
                left = max(0.0, ctx.think(turn_k.think_s) - (now() - wrec.end_time))
                await run_session(ctx, tree, trace.root, conv=conv, start_step=step_after,
                                  skip_spawns_before=tstar_t, first_wait_s=left)
                sr = session_record(tree, truncated=True)
                ctx.sessions.append(sr)
                ctx.emit("session", sr)
        while True:
            idx = claims.claim_fresh()
            if idx is None:
                return
            await run_tree(ctx, source.trace(idx), f"t{idx}", lane)

    await asyncio.gather(*(lane_loop(i) for i in range(n_lanes)))
    return start, deadline, claims.next


async def run_open(ctx: ReplayContext, source: WorkloadSource, point: LoadPoint,
                   control: RunControl) -> tuple[float, float | None, int]:
    claims = _Claims(ctx, control.num_sessions, control.first_index)
    if control.warmup == "requests" and control.warmup_requests > 0:
        await _warm_requests(ctx, source, control.warmup_requests,
                             point.max_concurrency or control.warmup_requests)
    if point.max_concurrency:
        ctx.limiter = asyncio.Semaphore(point.max_concurrency)
    rng = random.Random(f"arrivals:{ctx.seed}")
    shape = point.burstiness
    scale = 1.0 / (point.request_rate * shape)
    start = now()
    deadline = start + control.duration_s if control.duration_s else None
    ctx.deadline = deadline
    tasks = []
    due = start
    while True:
        await ctx.sleep(due - now())
        idx = claims.claim_fresh()
        if idx is None:
            break
        tasks.append(asyncio.create_task(run_tree(ctx, source.trace(idx), f"t{idx}", None,
                                                  first_issue=due)))
        due += rng.gammavariate(shape, scale)
    await asyncio.gather(*tasks)
    return start, deadline, claims.next


async def run_load(ctx: ReplayContext, source: WorkloadSource, point: LoadPoint,
                   control: RunControl) -> LoadResult:
    if point.concurrency is not None:
        start, deadline, next_index = await run_closed(ctx, source, point.concurrency, control)
    else:
        if control.warmup == "tstar":
            raise ValueError("warmup: 'tstar' needs a closed-loop concurrency load point")
        start, deadline, next_index = await run_open(ctx, source, point, control)
    prof_ends = [r.end_time for r in ctx.records if r.phase == PHASE_PROFILING and r.end_time]
    end = max(prof_ends + [deadline or start])
    return LoadResult(ctx.records, ctx.sessions, start, end, deadline, next_index)
