"""Raw per-request and per-session records: the source of truth every summary is recomputed from."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Iterable

PHASE_WARMUP = "warmup"
PHASE_PROFILING = "profiling"
STATUS_OK = "ok"
STATUS_ERROR = "error"


@dataclass
class RequestRecord:
    request_id: str
    session_id: str
    tree_id: str
    phase: str = PHASE_PROFILING
    parent_session_id: str | None = None
    turn_index: int = 0
    status: str = STATUS_OK
    error_class: str | None = None
    error_message: str | None = None
    http_status: int | None = None
    issue_time: float | None = None  # when the request became due (scheduled / credit issued)
    send_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    end_time: float | None = None
    input_tokens: int | None = None  # server usage.prompt_tokens
    output_tokens: int | None = None  # server usage.completion_tokens
    cached_tokens: int | None = None  # server usage.prompt_tokens_details.cached_tokens
    usage_reported: bool = False
    requested_input_tokens: int | None = None
    requested_output_tokens: int | None = None
    ignore_eos: bool = False
    finish_reason: str | None = None
    num_chunks: int = 0
    chunk_gaps_s: list[float] = field(default_factory=list)  # token-normalised inter-chunk gaps
    theoretical_hit_blocks: int = 0
    total_blocks: int = 0
    # Conversation lineage, for the token-level theoretical prefix-cache hit (prefix_reuse.py):
    extends_request_id: str | None = None  # earlier request whose prompt this prompt starts with
    output_fed_back: bool = False  # this request's output text follows its prompt in the next turn
    shared_prefix_tokens: int = 0  # leading system-prompt tokens every session starts with
    think_time_s: float = 0.0  # gap applied before this request (after caps/scale)
    think_time_original_s: float = 0.0
    output_text: str | None = None  # kept only in live mode (degeneration metrics)

    def to_json(self) -> str:
        return json.dumps(asdict(self), separators=(",", ":"))

    @classmethod
    def from_dict(cls, d: dict) -> "RequestRecord":
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})

    @property
    def ok(self) -> bool:
        return self.status == STATUS_OK


@dataclass
class SessionRecord:
    """Roll-up of one session *tree* (root session plus its sub-agents) = one task."""

    tree_id: str
    trace_id: str
    lane: int | None
    phase: str = PHASE_PROFILING
    truncated: bool = False  # started mid-timeline (t* warmup), excluded from task metrics
    completed: bool = False
    start_time: float | None = None  # send of first measured request
    end_time: float | None = None  # end of last request in the tree
    num_requests: int = 0
    num_failed: int = 0
    num_subagents: int = 0
    input_tokens: int = 0
    output_tokens: int = 0
    model_time_s: float = 0.0  # time with at least one request of the tree in flight
    think_time_s: float = 0.0  # latency minus model time (think / tool / join waits)
    ended_by: str | None = None  # None, "error", "context_overflow", "deadline"

    @property
    def latency_s(self) -> float | None:
        if self.start_time is None or self.end_time is None:
            return None
        return self.end_time - self.start_time

    def to_json(self) -> str:
        d = asdict(self)
        d["latency_s"] = self.latency_s
        return json.dumps(d, separators=(",", ":"))

    @classmethod
    def from_dict(cls, d: dict) -> "SessionRecord":
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})


def write_jsonl(path: Path, records: Iterable) -> None:
    with open(path, "w") as f:
        for r in records:
            f.write(r.to_json() + "\n")


def read_requests(path: Path) -> list[RequestRecord]:
    return [RequestRecord.from_dict(json.loads(line)) for line in open(path) if line.strip()]


def read_sessions(path: Path) -> list[SessionRecord]:
    return [SessionRecord.from_dict(json.loads(line)) for line in open(path) if line.strip()]


def busy_time(intervals: list[tuple[float, float]]) -> float:
    """Length of the union of [start, end] intervals."""
    total, cur_s, cur_e = 0.0, None, None
    for s, e in sorted(intervals):
        if cur_e is None or s > cur_e:
            if cur_e is not None:
                total += cur_e - cur_s
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
    if cur_e is not None:
        total += cur_e - cur_s
    return total
