"""What the cache manager keeps for one request, by request id (vLLM's ``req_to_blocks``)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Holding:
    block_table: list[int] = field(default_factory=list)   # pool pages, in token order
    state_slot: int = 0                                    # per-sequence state row (0 = none)
    block_keys: list[bytes] = field(default_factory=list)  # chained key of each full page of its tokens
    checkpoint_stops: list[int] = field(default_factory=list)  # prefill pauses here for a state checkpoint
    rolling_checkpoint: bytes | None = None                # newest checkpoint of the request's output
    staged: dict = field(default_factory=dict)             # lower-tier entries loaded for its hit


@dataclass(frozen=True)
class Admission:
    """What admitting a request settled, for the scheduler to write on it."""

    num_computed_tokens: int         # the prefix hit: tokens whose cache rows are already there
    num_cached_tokens: int | None    # prompt tokens the hit supplied; None after the first admission
