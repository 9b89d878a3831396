"""Seeded synthetic agentic sessions, emitted in the AgentX trace format.

A session grows its context turn by turn (assistant output + tool-result insert), waits a think /
tool time between turns, and may spawn sub-agents (fresh context, a few turns of their own) that a
later parent turn joins, or that run in the background. Every session starts with the same system
prefix. `SCALES` size the sessions so a run fits anything from 2 CPU cores to a GPU cluster.
"""

from __future__ import annotations

import random
from dataclasses import asdict, dataclass, fields

from .model import Trace
from .source import WorkloadSource, cycling_draw
from .trace_import import load_traces, parse_agentx


@dataclass(frozen=True)
class AgenticSpec:
    system_tokens: int = 128
    first_user_tokens: tuple[int, int] = (64, 128)
    turns: tuple[int, int] = (3, 6)
    output_tokens: tuple[int, int] = (16, 32)
    tool_result_tokens: tuple[int, int] = (32, 128)
    think_mean_s: float = 0.5
    think_max_s: float = 2.0
    subagent_prob: float = 0.25  # per parent turn
    subagent_turns: tuple[int, int] = (1, 2)
    subagent_first_tokens: tuple[int, int] = (64, 128)
    background_prob: float = 0.2  # sub-agent not joined by the parent
    max_context_tokens: int = 1536
    block_size: int = 64


SCALES = {
    # CI: a couple of seconds per session against a tiny CPU model.
    "small": AgenticSpec(system_tokens=64, first_user_tokens=(32, 64), turns=(2, 3),
                         output_tokens=(4, 8), tool_result_tokens=(16, 48), think_mean_s=0.05,
                         think_max_s=0.2, subagent_prob=0.35, subagent_turns=(1, 2),
                         subagent_first_tokens=(32, 64), max_context_tokens=512),
    # A few minutes for c = 1, 2, 4 on 2 CPU cores (short contexts: the architectures barely differ).
    "medium": AgenticSpec(),
    # Default compare: contexts where the architectures differ, sized for 2 CPU cores and the
    # tiny presets (16K positions): a shared 512-token system prompt, 10-11 turns, tool results of
    # 500-1400 tokens, so a task's context passes 8K tokens by its last turns (the standard model's
    # indexer and full MLA then cost far more than Flash's flat KDA state), 45-70K prompt tokens per
    # task without a prefix cache; think time and occasional sub-agents as in real agent loops.
    "long": AgenticSpec(system_tokens=512, first_user_tokens=(128, 256), turns=(10, 11),
                        output_tokens=(8, 24), tool_result_tokens=(500, 1400), think_mean_s=0.5,
                        think_max_s=2.0, subagent_prob=0.1, subagent_turns=(1, 2),
                        subagent_first_tokens=(256, 512), background_prob=0.3,
                        max_context_tokens=12288),
    # A single GPU node.
    "large": AgenticSpec(system_tokens=2048, first_user_tokens=(1024, 4096), turns=(8, 30),
                         output_tokens=(64, 800), tool_result_tokens=(128, 4096), think_mean_s=3.0,
                         think_max_s=10.0, subagent_prob=0.15, subagent_turns=(3, 10),
                         subagent_first_tokens=(1024, 8192), max_context_tokens=131072),
    # AgentX-like long contexts (cluster).
    "full": AgenticSpec(system_tokens=16384, first_user_tokens=(2048, 16384), turns=(20, 80),
                        output_tokens=(64, 2000), tool_result_tokens=(256, 16384), think_mean_s=4.0,
                        think_max_s=10.0, subagent_prob=0.1, subagent_turns=(5, 20),
                        subagent_first_tokens=(4096, 32768), max_context_tokens=262144),
}


def spec_from_scale(scale: str, **overrides) -> AgenticSpec:
    if scale not in SCALES:
        raise ValueError(f"scale: unknown {scale!r}; choose from {sorted(SCALES)}")
    names = {f.name for f in fields(AgenticSpec)}
    bad = [k for k in overrides if k not in names]
    if bad:
        raise ValueError(f"agentic spec: unknown field(s) {bad}")
    return AgenticSpec(**{**asdict(SCALES[scale]), **{k: v for k, v in overrides.items() if v is not None}})


def _blocks(rng_ids, n_tokens, block, prev_ids):
    """hash ids for a context of n_tokens that extends a context hashed as prev_ids."""
    need = -(-n_tokens // block)
    ids = list(prev_ids[: max(0, len(prev_ids) - 1)])  # last block was partial: it changes
    while len(ids) < need:
        ids.append(next(rng_ids))
    return ids[:need]


def generate_trace(spec: AgenticSpec, seed: int, index: int) -> dict:
    """One AgentX-format trace (deterministic in seed and index)."""
    rng = random.Random(f"agentic:{seed}:{index}")
    counter = iter(range(1, 1 << 30))
    blk = spec.block_size

    def think():
        return round(min(spec.think_max_s, rng.expovariate(1.0 / spec.think_mean_s)), 4) \
            if spec.think_mean_s > 0 else 0.0

    def session(first_tokens, n_turns, t0, with_subagents, sys_tokens):
        requests, t, n_in, ids = [], t0, sys_tokens + first_tokens, []
        last_end = t0
        n_out_prev = 0
        for k in range(n_turns):
            n_out = rng.randint(*spec.output_tokens)
            if k > 0:
                grow = n_out_prev + rng.randint(*spec.tool_result_tokens)
                if n_in + grow + n_out > spec.max_context_tokens:
                    break
                n_in += grow
            ids = _blocks(counter, n_in, blk, ids)
            api = round(0.02 * n_out + 0.0005 * n_in, 4)  # nominal recorded service time
            requests.append({"t": round(t, 4), "type": "n", "in": n_in, "out": n_out,
                             "hash_ids": ids, "api_time": api, "stop": "tool_use"})
            end = t + api
            last_end = max(last_end, end)
            n_out_prev = n_out
            if with_subagents and k < n_turns - 1 and rng.random() < spec.subagent_prob:
                st = end + round(rng.uniform(0.0, 0.05), 4)
                sub_reqs, sub_end = session(rng.randint(*spec.subagent_first_tokens),
                                            rng.randint(*spec.subagent_turns), st, False, 0)
                background = rng.random() < spec.background_prob
                requests.append({"t": round(st, 4), "type": "subagent",
                                 "agent_id": f"agent_{len(requests):03d}", "subagent_type": "Explore",
                                 "status": "background" if background else "completed",
                                 "duration_ms": round((sub_end - st) * 1000, 1),
                                 "requests": sub_reqs})
                # A joined sub-agent: the parent resumes after it ended; background: right away.
                end = end if background else max(end, sub_end)
                last_end = max(last_end, sub_end)
            t = end + think()
        requests[-1]["stop"] = "end_turn"
        return requests, last_end

    reqs, _ = session(rng.randint(*spec.first_user_tokens), rng.randint(*spec.turns), 0.0, True,
                      spec.system_tokens)
    return {"id": f"synthetic-agentic-{seed}-{index}", "models": [], "block_size": blk,
            "hash_id_scope": "local", "tool_tokens": 0, "system_tokens": spec.system_tokens,
            "requests": reqs}


def agentic_source(seed: int, spec: AgenticSpec | None = None, trace_file: str | None = None,
                   scale: str = "medium") -> WorkloadSource:
    if trace_file:
        traces = load_traces(trace_file)
        return WorkloadSource("agentic", {"workload": "agentic", "trace_file": str(trace_file),
                                          "num_traces": len(traces),
                                          "trace_ids": [t.trace_id for t in traces][:50], "seed": seed},
                              cycling_draw(traces, seed))
    spec = spec or SCALES[scale]

    def make(idx: int) -> Trace:
        return parse_agentx(generate_trace(spec, seed, idx), where=f"synthetic[{idx}]")

    return WorkloadSource("agentic", {"workload": "agentic", "generator": "synthetic",
                                      "scale": scale, "seed": seed, **asdict(spec)}, make)
