"""W3: synthetic multi-turn conversations with a controlled shared prefix and think time.

All conversations share a global prefix (system + tools) of `shared_prefix_tokens`; each
conversation then grows by its assistant answers and a new user message per turn. Emitted in the
AgentX format with `hash_id_scope = "global"`: shared-prefix blocks carry the same ids in every
conversation, so the theoretical prefix-cache hit can be compared with the server-reported one.
"""

from __future__ import annotations

import random
from dataclasses import asdict, dataclass

from .model import Trace
from .source import WorkloadSource
from .trace_import import parse_agentx


@dataclass(frozen=True)
class MultiTurnSpec:
    turns: int = 4
    shared_prefix_tokens: int = 256
    first_user_tokens: int = 64
    user_tokens_per_turn: int = 48
    output_tokens: tuple[int, int] = (16, 32)
    think: str = "exponential"  # "fixed" | "exponential" | "uniform"
    think_mean_s: float = 0.5
    block_size: int = 64


def _think(rng: random.Random, spec: MultiTurnSpec) -> float:
    if spec.think_mean_s <= 0:
        return 0.0
    if spec.think == "fixed":
        return spec.think_mean_s
    if spec.think == "uniform":
        return rng.uniform(0, 2 * spec.think_mean_s)
    if spec.think == "exponential":
        return rng.expovariate(1.0 / spec.think_mean_s)
    raise ValueError(f"think: unknown distribution {spec.think!r}")


def generate_conversation(spec: MultiTurnSpec, seed: int, index: int) -> dict:
    if spec.turns < 1:
        raise ValueError("turns: must be >= 1")
    rng = random.Random(f"multiturn:{seed}:{index}")
    blk = spec.block_size
    shared_full = spec.shared_prefix_tokens // blk
    shared_ids = list(range(1, shared_full + 1))
    base = (index + 1) << 24  # conversation-private id range
    reqs, n_in, t = [], spec.shared_prefix_tokens + spec.first_user_tokens, 0.0
    prev_out = 0
    for k in range(spec.turns):
        n_out = rng.randint(*spec.output_tokens)
        if k > 0:
            n_in += prev_out + spec.user_tokens_per_turn
        need = -(-n_in // blk)
        ids = shared_ids + [base + j for j in range(need - len(shared_ids))]
        think = round(_think(rng, spec), 4) if k > 0 else 0.0
        t += think
        reqs.append({"t": round(t, 4), "type": "n", "in": n_in, "out": n_out, "hash_ids": ids,
                     "think_time": think, "stop": "end_turn"})
        prev_out = n_out
    return {"id": f"synthetic-multiturn-{seed}-{index}", "block_size": blk,
            "hash_id_scope": "global", "system_tokens": spec.shared_prefix_tokens, "requests": reqs}


def multiturn_source(seed: int, spec: MultiTurnSpec | None = None) -> WorkloadSource:
    spec = spec or MultiTurnSpec()
    _think(random.Random(0), spec)  # validate the distribution name early

    def make(idx: int) -> Trace:
        return parse_agentx(generate_conversation(spec, seed, idx), where=f"multiturn[{idx}]")

    return WorkloadSource("multiturn", {"workload": "multiturn", "seed": seed, **asdict(spec)}, make)
