"""Replay of one session tree (root session + sub-agents) against the target.

Each turn carries the whole growing message array: a system prefix (identical in every session, so
it is a shared cacheable prefix), the first user message starting with the tree's cache-bust nonce,
then alternating assistant / user messages. In `recorded` mode the assistant history is the
synthesized recorded output and the request asks for exactly the recorded output length with
`ignore_eos`; in `live` mode the server's own output is fed back and the length is free.
A context shorter than the history so far (compaction) restarts the message array.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Callable

import httpx

from .client import Target, send_request
from .clock import now
from .records import PHASE_PROFILING, RequestRecord, SessionRecord, busy_time
from .text_synth import TextSynth
from .workloads.model import Session, Spawn, Trace, Turn


class BenchAbort(RuntimeError):
    """The run cannot go on (e.g. a root-session warmup request failed)."""


@dataclass
class ReplayContext:
    client: httpx.AsyncClient
    target: Target
    synth: TextSynth
    mode: str = "recorded"  # "recorded" | "live"
    think_cap_s: float = 10.0
    think_scale: float = 1.0
    seed: int = 0
    records: list[RequestRecord] = field(default_factory=list)
    sessions: list[SessionRecord] = field(default_factory=list)
    deadline: float | None = None
    stop: asyncio.Event = field(default_factory=asyncio.Event)
    limiter: asyncio.Semaphore | None = None  # open loop: cap on in-flight requests
    on_event: Callable[[str, object], None] | None = None
    nonce_salt: str = ""  # load-point label: the same trees at another load point do not share cache
    _seen_blocks: dict = field(default_factory=dict)

    def __post_init__(self):
        if self.mode not in ("recorded", "live"):
            raise ValueError(f"mode: expected 'recorded' or 'live', got {self.mode!r}")
        if self.think_cap_s < 0 or self.think_scale < 0:
            raise ValueError("think_cap_s / think_scale: must be >= 0")

    def stopping(self) -> bool:
        if self.deadline is not None and now() >= self.deadline:
            self.stop.set()
        return self.stop.is_set()

    def think(self, original_s: float) -> float:
        return min(self.think_cap_s, max(0.0, original_s)) * self.think_scale

    async def sleep(self, seconds: float) -> None:
        """Sleep, but wake early when the run is stopping."""
        if seconds <= 0:
            return
        if self.deadline is not None:
            seconds = min(seconds, max(0.0, self.deadline - now()))
        try:
            await asyncio.wait_for(self.stop.wait(), timeout=seconds)
        except asyncio.TimeoutError:
            pass

    def emit(self, kind: str, obj) -> None:
        if self.on_event is not None:
            self.on_event(kind, obj)


@dataclass
class TreeState:
    tree_id: str
    trace: Trace
    lane: int | None
    phase: str = PHASE_PROFILING
    records: list[RequestRecord] = field(default_factory=list)
    subagents: int = 0
    ended_by: str | None = None


class Conversation:
    """Message array of one session, grown turn by turn and never rewritten.

    Each prompt starts with the previous prompt plus the assistant message that answered it, so
    a prefix cache can reuse the whole history. In live mode that answer is the server's output
    text, verbatim. Only a trace whose context shrinks (compaction) starts a fresh array. The
    context size is tracked in the trace's own (recorded) lengths: a live answer longer or
    shorter than the recorded one changes what is sent, never whether history is kept.
    """

    def __init__(self, ctx: ReplayContext, tree: TreeState, session: Session):
        self.ctx, self.tree, self.session = ctx, tree, session
        self.messages: list[dict] = []
        self.trace_tokens = 0  # context tokens so far as the trace counts them
        self.extends: str | None = None  # request whose prompt the array now starts with
        self.shared_prefix_tokens = 0  # system-prompt tokens at the start of the array

    def _key(self, turn: Turn, part: str):
        return (self.tree.trace.trace_id, self.session.session_id, turn.index, part)

    def prepare(self, turn: Turn) -> list[dict]:
        synth = self.ctx.synth
        if not self.messages or turn.input_tokens < self.trace_tokens:
            self.messages, self.trace_tokens, self.extends = [], 0, None
            self.shared_prefix_tokens = 0
            if self.session.system_tokens > 0:
                n_sys = min(self.session.system_tokens, turn.input_tokens - 1)
                system = synth.text(n_sys, "system")
                self.messages.append({"role": "system", "content": system})
                self.trace_tokens += n_sys
                self.shared_prefix_tokens = synth.count(system)
            nonce = synth.nonce(self.ctx.seed, self.ctx.nonce_salt, self.tree.tree_id,
                                self.session.session_id)
            n_user = max(1, turn.input_tokens - self.trace_tokens - synth.count(nonce))
            self.messages.append({"role": "user",
                                  "content": nonce + "\n" + synth.text(n_user, *self._key(turn, "u"))})
        else:
            n_new = max(1, turn.input_tokens - self.trace_tokens)
            self.messages.append({"role": "user", "content": synth.text(n_new, *self._key(turn, "u"))})
        self.trace_tokens = turn.input_tokens
        return list(self.messages)

    def absorb(self, turn: Turn, rec: RequestRecord | None, live_text: str = "") -> None:
        """Append the assistant answer: the live output verbatim, or the recorded one (rec None:
        a turn never sent; a failed request). `rec` then becomes the request this array extends."""
        if self.ctx.mode == "live" and rec is not None and rec.ok:
            self.messages.append({"role": "assistant", "content": live_text})
            rec.output_fed_back = True
        else:
            self.messages.append({"role": "assistant",
                                  "content": self.ctx.synth.text(turn.output_tokens, *self._key(turn, "a"))})
        self.trace_tokens += turn.output_tokens
        if rec is not None:
            self.extends = rec.request_id


async def run_turn(ctx: ReplayContext, tree: TreeState, session: Session, conv: Conversation,
                   turn: Turn, phase: str, issue_time: float, think_s: float) -> RequestRecord:
    messages = conv.prepare(turn)
    ns = tree.tree_id if tree.trace.hash_id_scope == "local" else "global"
    seen = ctx._seen_blocks.setdefault(ns, set())
    rec = RequestRecord(request_id=f"{tree.tree_id}:{session.session_id}:{turn.index}"
                                   + (":w" if phase != PHASE_PROFILING else ""),
                        session_id=f"{tree.tree_id}:{session.session_id}", tree_id=tree.tree_id,
                        phase=phase, turn_index=turn.index, issue_time=issue_time,
                        parent_session_id=(f"{tree.tree_id}:{session.session_id.rsplit('/', 1)[0]}"
                                           if "/" in session.session_id else None),
                        requested_input_tokens=turn.input_tokens,
                        theoretical_hit_blocks=sum(1 for h in turn.hash_ids if h in seen),
                        total_blocks=len(turn.hash_ids), think_time_s=think_s,
                        think_time_original_s=turn.think_s, extends_request_id=conv.extends,
                        shared_prefix_tokens=conv.shared_prefix_tokens)
    seen.update(turn.hash_ids)
    ignore_eos = ctx.mode == "recorded"
    if ctx.limiter is not None:
        async with ctx.limiter:
            text = await send_request(ctx.client, ctx.target, messages, turn.output_tokens,
                                      ignore_eos, rec, keep_text=ctx.mode == "live")
    else:
        text = await send_request(ctx.client, ctx.target, messages, turn.output_tokens, ignore_eos,
                                  rec, keep_text=ctx.mode == "live")
    conv.absorb(turn, rec, text)
    ctx.records.append(rec)
    tree.records.append(rec)
    ctx.emit("request", rec)
    return rec


async def run_session(ctx: ReplayContext, tree: TreeState, session: Session,
                      conv: Conversation | None = None, start_step: int = 0,
                      skip_spawns_before: float | None = None, first_wait_s: float | None = None,
                      first_issue: float | None = None) -> None:
    """Run `session.steps[start_step:]`; sub-agents run as tasks and are joined as recorded."""
    conv = conv or Conversation(ctx, tree, session)
    tasks: dict[str, asyncio.Task] = {}
    first = True
    try:
        for step in session.steps[start_step:]:
            if isinstance(step, Spawn):
                if skip_spawns_before is not None and step.t < skip_spawns_before:
                    continue
                tree.subagents += 1
                tasks[step.agent_id] = asyncio.create_task(
                    _run_subagent(ctx, tree, step, ctx.think(step.delay_s)))
                continue
            for j in step.joins:
                if j in tasks:
                    await tasks[j]
            if ctx.stopping():
                tree.ended_by = tree.ended_by or "deadline"
                break
            think = ctx.think(step.think_s)
            wait = think if not (first and first_wait_s is not None) else first_wait_s
            issue = first_issue if (first and first_issue is not None) else now() + wait
            await ctx.sleep(issue - now())
            if ctx.stopping():
                tree.ended_by = tree.ended_by or "deadline"
                break
            first = False
            rec = await run_turn(ctx, tree, session, conv, step, tree.phase, issue, think)
            if rec.error_class == "context_overflow":
                tree.ended_by = "context_overflow"
                break
    finally:
        if tasks:
            await asyncio.gather(*tasks.values(), return_exceptions=True)


async def _run_subagent(ctx: ReplayContext, tree: TreeState, spawn: Spawn, delay: float) -> None:
    await ctx.sleep(delay)
    if not ctx.stopping():
        await run_session(ctx, tree, spawn.session)


def session_record(tree: TreeState, truncated: bool) -> SessionRecord:
    recs = [r for r in tree.records if r.phase == tree.phase and r.send_time is not None]
    sr = SessionRecord(tree_id=tree.tree_id, trace_id=tree.trace.trace_id, lane=tree.lane,
                       phase=tree.phase, truncated=truncated, num_subagents=tree.subagents,
                       ended_by=tree.ended_by)
    if recs:
        sr.start_time = min(r.send_time for r in recs)
        sr.end_time = max(r.end_time for r in recs)
        sr.num_requests = len(recs)
        sr.num_failed = sum(1 for r in recs if not r.ok)
        sr.input_tokens = sum(r.input_tokens or 0 for r in recs)
        sr.output_tokens = sum(r.output_tokens or 0 for r in recs)
        sr.model_time_s = busy_time([(r.send_time, r.end_time) for r in recs])
        sr.think_time_s = max(0.0, sr.latency_s - sr.model_time_s)
    if sr.num_failed and sr.ended_by is None:
        sr.ended_by = "error"
    sr.completed = bool(recs) and sr.ended_by is None
    return sr


async def run_tree(ctx: ReplayContext, trace: Trace, tree_id: str, lane: int | None,
                   first_issue: float | None = None, phase: str = PHASE_PROFILING) -> SessionRecord:
    """Replay a whole tree from turn 0 (a fresh session)."""
    tree = TreeState(tree_id=tree_id, trace=trace, lane=lane, phase=phase)
    await run_session(ctx, tree, trace.root, first_wait_s=0.0, first_issue=first_issue)
    sr = session_record(tree, truncated=False)
    ctx.sessions.append(sr)
    ctx.emit("session", sr)
    return sr
