"""Task profiles: the turns of one agentic task as (new input, cached prefix, output) tokens.

Sources: a built-in illustrative profile, a compact spec string
(``turns=30,prefix=12k,in=1.5k,out=400``) or an AgentX / Weka trace file (requests with ``in``,
``out``, ``hash_ids``; subagent requests flattened in order; the cached prefix of a request is
its longest run of leading block hashes already seen in an earlier request).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from .units import parse_tokens


@dataclass(frozen=True)
class Turn:
    new_tokens: int     # prompt tokens that must be prefilled
    cached: int         # prompt tokens already in the prefix cache
    output: int

    @property
    def context_after(self) -> int:
        return self.cached + self.new_tokens + self.output


@dataclass(frozen=True)
class TaskProfile:
    name: str
    turns: tuple[Turn, ...]
    description: str

    @property
    def input_tokens(self) -> int:
        return sum(t.new_tokens + t.cached for t in self.turns)

    @property
    def prefilled_tokens(self) -> int:
        return sum(t.new_tokens for t in self.turns)

    @property
    def output_tokens(self) -> int:
        return sum(t.output for t in self.turns)

    @property
    def max_context(self) -> int:
        return max(t.context_after for t in self.turns)


DEFAULT_SPEC = "turns=30,prefix=12k,in=1.5k,out=400"


def profile_from_spec(spec: str) -> TaskProfile:
    """An agent loop: a system+tools prefix, then ``turns`` turns each adding ``in`` new tokens
    (user / tool results) and generating ``out`` tokens that stay in the cache."""
    fields = {"turns": "30", "prefix": "12k", "in": "1.5k", "out": "400"}
    for part in spec.split(","):
        if not part.strip():
            continue
        key, sep, value = part.partition("=")
        key = key.strip()
        if not sep or key not in fields:
            raise ValueError(f"--task: {part!r} is not one of turns=, prefix=, in=, out=")
        fields[key] = value
    n = parse_tokens(fields["turns"], "--task turns")
    prefix = parse_tokens(fields["prefix"], "--task prefix")
    new = parse_tokens(fields["in"], "--task in")
    out = parse_tokens(fields["out"], "--task out")
    turns, cached = [], 0
    for i in range(n):
        fresh = new + (prefix if i == 0 else 0)
        turns.append(Turn(new_tokens=fresh, cached=cached, output=out))
        cached += fresh + out
    desc = f"{n} turns, {prefix} prefix tokens, +{new} input and {out} output tokens per turn, prefix cache on"
    return TaskProfile(name=spec, turns=tuple(turns), description=desc)


def _flatten(requests: list, out: list) -> None:
    for r in requests:
        if r.get("type") == "subagent" or "requests" in r:
            _flatten(r.get("requests", []), out)
        else:
            out.append(r)


def profile_from_trace(path: str | Path) -> TaskProfile:
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"--task: cannot read trace {path}: {exc}") from exc
    if not isinstance(data, dict) or not isinstance(data.get("requests"), list):
        raise ValueError(f"--task: trace {path} has no 'requests' list")
    block = int(data.get("block_size", 64))
    flat: list[dict] = []
    _flatten(data["requests"], flat)
    seen: list[tuple] = []
    turns = []
    for i, r in enumerate(flat):
        for key in ("in", "out"):
            if not isinstance(r.get(key), int) or r[key] < 0:
                raise ValueError(f"--task: trace request {i} has no valid {key!r} token count")
        hashes = tuple(r.get("hash_ids") or ())
        common = max((_common_prefix(hashes, s) for s in seen), default=0)
        cached = min(common * block, max(r["in"] - 1, 0))
        turns.append(Turn(new_tokens=r["in"] - cached, cached=cached, output=r["out"]))
        seen.append(hashes)
    if not turns:
        raise ValueError(f"--task: trace {path} has no requests")
    desc = f"trace {path.name}: {len(turns)} requests (subagents flattened, run back to back)"
    return TaskProfile(name=path.name, turns=tuple(turns), description=desc)


def _common_prefix(a: tuple, b: tuple) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def load_task(text: str | None) -> TaskProfile:
    if not text or text == "agentic":
        return profile_from_spec(DEFAULT_SPEC)
    if Path(text).expanduser().is_file():
        return profile_from_trace(Path(text).expanduser())
    if "=" in text:
        return profile_from_spec(text)
    raise ValueError(f"--task {text!r} is neither 'agentic', a trace file nor a spec like {DEFAULT_SPEC}")
