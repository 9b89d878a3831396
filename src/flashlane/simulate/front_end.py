"""The server's time outside engine steps: what a request spends between the client and the engine.

A served request crosses the API process twice: on the way in (HTTP, the chat template,
tokenisation, the hop to the engine process) and on the way out (the hop back, detokenisation,
the SSE write). The engine also idles a little between busy steps (handling the messages that
arrived, sending the step's outputs). None of it is in the step records, all of it is in the
client's latencies, and at low concurrency it is on the critical path of every turn. The terms
are measured on a real server by ``flashlane calibrate`` (``measure``/``fit`` here); a
simulation without a calibration of them assumes zero and says so.

The served engine's steps also run slower than the same steps of the engine alone, which is what
the step-cost grid measures: the API process, its event loop and the client share the cores.
``served_prefill_scale`` and ``served_decode_scale`` are the measured ratio (sum of the served
steps' times over the fitted model's prediction for the same compositions), for steps with a
prefill chunk and for decode-only steps, measured with one request at a time; a simulation of a
server multiplies its step costs by them. With more requests in flight the API process streams
more tokens and its work may compete harder for the cores: ``served_prefill_contention`` and
``served_decode_contention`` are the fitted extra slowdown per additional sequence in a step with a
prefill chunk and in a decode-only step, measured with up to ``served_contention_seqs`` requests at
once (the scale is held there beyond it: the fit never extrapolates in concurrency). The two kinds
are fitted apart because they differ: SmolLM2 on a Zen 3 core, 8 streams, decode-only steps ran
1.31x the engine alone's fit and steps with a prefill chunk 1.14x, as one at a time (2026-12-05).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ..analyze.step_cost import StepShape


MIN_CONTENTION_FACTOR = 0.5      # a fitted contention never makes a served step less than half as long


@dataclass(frozen=True)
class FrontEnd:
    request_s: float = 0.0            # send -> the request in the engine: fixed part
    per_prompt_token_s: float = 0.0   # ... and per prompt token (template + tokenisation)
    token_s: float = 0.0              # a step's end -> its token at the client
    step_gap_s: float = 0.0           # the engine's pause between two busy steps
    source: str = "not measured: zero front-end time assumed"
    served_prefill_scale: float = 1.0  # served steps with a prefill chunk / the engine alone's (fitted) time
    served_decode_scale: float = 1.0   # the same for decode-only steps
    served_prefill_contention: float = 0.0  # extra slowdown per additional sequence, steps with a prefill chunk
    served_decode_contention: float = 0.0   # ... decode-only steps
    served_contention_seqs: int = 1    # the most sequences per step they were measured with

    def __post_init__(self):
        for name in ("request_s", "per_prompt_token_s", "token_s", "step_gap_s"):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and v >= 0):
                raise ValueError(f"front_end.{name} must be a number >= 0, got {v!r}")
        for name in ("served_prefill_scale", "served_decode_scale"):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and v > 0):
                raise ValueError(f"front_end.{name} must be a number > 0, got {v!r}")
        for name in ("served_prefill_contention", "served_decode_contention"):
            c = getattr(self, name)
            if not (isinstance(c, (int, float)) and math.isfinite(c)):
                raise ValueError(f"front_end.{name} must be a finite number, got {c!r}")
        n = self.served_contention_seqs
        if not (isinstance(n, int) and n >= 1):
            raise ValueError(f"front_end.served_contention_seqs must be an integer >= 1, got {n!r}")

    def step_scale(self, has_prefill: bool, num_seqs: int = 1) -> float:
        base, c = ((self.served_prefill_scale, self.served_prefill_contention) if has_prefill
                   else (self.served_decode_scale, self.served_decode_contention))
        extra = min(max(num_seqs, 1), self.served_contention_seqs) - 1
        return base * max(MIN_CONTENTION_FACTOR, 1.0 + c * extra)

    def served(self, seconds: Callable[["StepShape"], float]) -> Callable[["StepShape"], float]:
        """The engine alone's step cost ``seconds`` as a served step's: times its step scale."""
        return lambda shape: seconds(shape) * self.step_scale(bool(shape.prefill), shape.num_seqs)

    def admission_s(self, prompt_tokens: int) -> float:
        return self.request_s + self.per_prompt_token_s * prompt_tokens

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: Mapping | None) -> "FrontEnd":
        if not d:
            return cls()
        d = dict(d)
        if "served_contention" in d:     # calibration method 2: one contention fitted over both kinds
            both = d.pop("served_contention")
            d.setdefault("served_prefill_contention", both)
            d.setdefault("served_decode_contention", both)
        unknown = sorted(set(d) - set(cls.__dataclass_fields__))
        if unknown:
            raise ValueError(f"front_end: unknown field(s) {', '.join(unknown)}")
        return cls(**dict(d))

    def zero(self) -> "FrontEnd":
        """The same with no host time at all (a counterfactual)."""
        return FrontEnd(source="host time set to zero")


@dataclass(frozen=True)
class RequestTiming:
    """One measured request: its prompt length, the client's send time, the start of the first
    engine step that computed it, and (token arrival at the client, end of the step that made it)
    for each streamed token; all on one clock."""
    prompt_tokens: int
    send: float
    first_step_start: float
    token_delays: tuple[float, ...]      # arrival - step end, per token


def served_scales(steps: Sequence[tuple[bool, float, float]]) -> tuple[float, float]:
    """(prefill, decode) scales from served steps given as (has a prefill chunk, measured s,
    predicted s): the ratio of the sums, so long steps weigh as they do in a task's time; 1.0
    where there are no such steps."""
    out = []
    for kind in (True, False):
        meas = sum(m for p, m, _ in steps if p == kind)
        pred = sum(q for p, _, q in steps if p == kind)
        out.append(meas / pred if meas > 0 and pred > 0 else 1.0)
    return out[0], out[1]


def served_contention(steps: Sequence[tuple[bool, int, float, float]],
                      scales: tuple[float, float]) -> tuple[float, float]:
    """(prefill, decode) extra slowdown per additional sequence, from served steps run with several
    requests in flight, given as (has a prefill chunk, sequences, measured s, predicted s): per step
    kind, least squares of measured = predicted x scale x (1 + c x (sequences - 1)), with ``scales``
    the one-at-a-time (prefill, decode) scales; 0.0 for a kind where no step had more than one
    sequence."""
    out = []
    for kind, scale in ((True, scales[0]), (False, scales[1])):
        num = den = 0.0
        for has_prefill, seqs, meas, pred in steps:
            if has_prefill != kind:
                continue
            x = pred * scale * (seqs - 1)
            num += x * (meas - pred * scale)
            den += x * x
        out.append(num / den if den > 0 else 0.0)
    return out[0], out[1]


def fit(requests: Sequence[RequestTiming], step_gaps: Sequence[float], source: str,
        scales: tuple[float, float] = (1.0, 1.0), contention: tuple[float, float] = (0.0, 0.0),
        contention_seqs: int = 1) -> FrontEnd:
    """Least squares of admission delay = request_s + per_prompt_token_s x prompt tokens (both
    kept >= 0); the median token delay; the median pause between back-to-back steps; ``scales``
    (from ``served_scales``) and the (prefill, decode) contention (from ``served_contention``) as they are."""
    if len(requests) < 2:
        raise ValueError(f"front-end fit: need at least 2 measured requests, got {len(requests)}")
    xs = [float(r.prompt_tokens) for r in requests]
    ys = [max(0.0, r.first_step_start - r.send) for r in requests]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    slope = max(0.0, sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx) if sxx > 0 else 0.0
    intercept = my - slope * mx
    if intercept < 0:      # refit through the origin
        intercept, slope = 0.0, max(0.0, sum(x * y for x, y in zip(xs, ys)) / max(sum(x * x for x in xs), 1e-12))
    delays = [d for r in requests for d in r.token_delays if d >= 0]
    return FrontEnd(request_s=intercept, per_prompt_token_s=slope,
                    token_s=statistics.median(delays) if delays else 0.0,
                    step_gap_s=statistics.median(step_gaps) if step_gaps else 0.0,
                    served_prefill_scale=scales[0], served_decode_scale=scales[1],
                    served_prefill_contention=contention[0], served_decode_contention=contention[1],
                    served_contention_seqs=contention_seqs, source=source)
