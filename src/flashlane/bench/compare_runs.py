"""What a comparison measured, as data: the two targets, and per stack and load point each
target's pooled run with its interleaved rounds."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

from .load import LoadPoint
from .rounds import RoundRun
from .server_launch import ServerProcess
from .stacks import Stack


@dataclass
class CompareTarget:
    spec: str  # what the user gave
    name: str
    base_url: str | None = None
    model: str | None = None  # to start, or served model name
    server: ServerProcess | None = None
    role: str = "hybrid"


@dataclass
class PointRun:
    point: LoadPoint
    summary: dict              # the side's rounds pooled (rounds.merge_side)
    run_dir: Path              # the pooled folder; each round has a folder below it
    latencies: list[float]
    components: dict | None
    turns: list
    machine: dict              # co-tenant load over the side's rounds
    rounds: list[RoundRun] = field(default_factory=list)
    partition: dict | None = None   # measured attribution per task (attribution.mean_partition)
    simulated: dict | None = None   # the same rounds in simulated time, with the errors (compare's Simulator)


@dataclass
class StackRun:
    name: str  # stack name, or "as given" without stacks
    stack: Stack | None
    flags: dict[str, list[str]] = field(default_factory=dict)  # target name -> stack flags
    points: dict[str, list[PointRun]] = field(default_factory=dict)  # target name -> per point
    cfgs: dict = field(default_factory=dict)  # target name -> the BenchConfig its points ran with


def is_url(s: str) -> bool:
    return s.startswith("http://") or s.startswith("https://")


def safe_name(s: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "_", s.replace("http://", "").replace("https://", "")).strip("_")


def ratio(a, b):
    return a / b if a is not None and b not in (None, 0) else None


def load_of(point: LoadPoint) -> float:
    return point.concurrency if point.concurrency is not None else point.request_rate
