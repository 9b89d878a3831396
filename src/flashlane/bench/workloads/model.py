"""The session-tree model every workload replays: turns, sub-agent spawns and joins."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Union


@dataclass
class Turn:
    index: int  # position among this session's turns
    t: float  # recorded start offset (s)
    input_tokens: int
    output_tokens: int
    hash_ids: list[int] = field(default_factory=list)
    think_s: float = 0.0  # recorded end-to-start gap before dispatch (after any joins)
    joins: list[str] = field(default_factory=list)  # sub-agents that must finish first
    stop: str | None = None


@dataclass
class Spawn:
    agent_id: str
    t: float
    delay_s: float  # recorded gap from the parent's previous turn end to the spawn
    session: "Session"
    gating: bool = False  # a later parent turn waits for it (join)


Step = Union[Turn, Spawn]


@dataclass
class Session:
    session_id: str  # path inside the tree: "root", "root/agent_001", ...
    steps: list[Step] = field(default_factory=list)
    agent_type: str | None = None
    system_tokens: int = 0

    @property
    def turns(self) -> list[Turn]:
        return [s for s in self.steps if isinstance(s, Turn)]

    @property
    def spawns(self) -> list[Spawn]:
        return [s for s in self.steps if isinstance(s, Spawn)]

    def walk(self):
        """This session and every nested sub-agent session."""
        yield self
        for sp in self.spawns:
            yield from sp.session.walk()


@dataclass
class Trace:
    trace_id: str
    root: Session
    block_size: int = 64
    hash_id_scope: str = "local"  # "local": namespaced per replayed tree; "global": workload-wide

    @property
    def num_requests(self) -> int:
        return sum(len(s.turns) for s in self.root.walk())
