"""W2: fixed input/output lengths, unique random prompts (prefix caching defeated)."""

from __future__ import annotations

import random
from dataclasses import asdict, dataclass

from .model import Session, Trace, Turn
from .source import WorkloadSource


@dataclass(frozen=True)
class FixedSpec:
    input_tokens: int = 1024
    output_tokens: int = 1024
    range_ratio: float = 0.0  # lengths uniform in [L*(1-r), L*(1+r)]


def fixed_source(seed: int, spec: FixedSpec | None = None) -> WorkloadSource:
    spec = spec or FixedSpec()
    if spec.input_tokens < 1:
        raise ValueError("input_tokens: must be >= 1")
    if spec.output_tokens < 1:
        raise ValueError("output_tokens: must be >= 1")
    if not 0.0 <= spec.range_ratio < 1.0:
        raise ValueError("range_ratio: must be in [0, 1)")

    def length(rng, n):
        r = spec.range_ratio
        return max(1, rng.randint(int(n * (1 - r)), int(n * (1 + r)))) if r else n

    def make(idx: int) -> Trace:
        rng = random.Random(f"fixed:{seed}:{idx}")
        n_in, n_out = length(rng, spec.input_tokens), length(rng, spec.output_tokens)
        turn = Turn(index=0, t=0.0, input_tokens=n_in, output_tokens=n_out)
        return Trace(trace_id=f"fixed-{seed}-{idx}", root=Session("root", [turn]))

    return WorkloadSource("fixed", {"workload": "fixed", "seed": seed, **asdict(spec)}, make,
                          default_endpoint="completions")
