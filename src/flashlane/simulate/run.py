"""``flashlane bench`` in simulated time: the bench's own workload replay, records, summary and
reports, against a simulated server instead of a real one.

A ``SimSetup`` says what is simulated: the model's config, the engine arguments the server would
run with, the step-cost model, the front end's host time and the prompt tokenizer. A
``SimulatedServer`` keeps one engine across the load points (or rounds) run against it; each run
gets a ``SimServer`` on a virtual-time event loop (``virtual_time``) that starts where the last
one stopped, reached through an in-memory HTTP transport; the bench client, the load generator and the metrics are unchanged, so
the run folder has bench's schema (manifest, requests, sessions, summary, telemetry with the
simulated engine's step records, reports) and every reader of bench results reads it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from ..analyze.step_cost import StepShape
from ..bench.load import LoadPoint
from ..bench.runner import BenchConfig, Harness, run_bench
from ..bench.telemetry import Telemetry
from ..cache_spec import cache_spec
from ..config import ModelConfig
from .front_end import FrontEnd
from .prompts import PromptTokenizer
from .sim_engine import SimEngine
from .sim_server import SimServer
from .virtual_time import run_virtual

BASE_URL = "http://simulated"


@dataclass
class SimSetup:
    model: str                                  # the served model name
    cfg: ModelConfig
    cost: Callable[[StepShape], float]          # seconds of one engine step
    engine_args: dict                           # as `flashlane serve` would run (dtype resolved)
    prompts: PromptTokenizer
    front_end: FrontEnd = field(default_factory=FrontEnd)
    devices: tuple[str, ...] = ()               # simulated accelerators (per-GPU throughput), none for a CPU
    assumptions: dict = field(default_factory=dict)   # recorded in each run's manifest

    def engine(self) -> SimEngine:
        args = dict(self.engine_args)
        dtype = args.pop("dtype", "bfloat16")
        for ignored in ("num_threads", "kernel_backend", "linear_kernel", "seed", "skip_tokenizer_init", "compile_sizes", "device"):
            args.pop(ignored, None)
        return SimEngine(self.cfg, self.cost, dtype=dtype, **args)

    def server_info(self, engine: SimEngine) -> dict:
        """What /v1/models says of the simulated server (the fields bench reads)."""
        spec = cache_spec(self.cfg, engine.args.page_size, engine.args.kv_cache_dtype)
        dtype = engine.args.dtype
        return {"dtype": dtype, "page_size": spec.page_size, "simulated": True,
                "cache_bytes_per_token": spec.bytes_per_token(dtype), "state_bytes_per_sequence": spec.bytes_per_slot(dtype),
                "num_pages": engine.plan.num_pages, "num_slots": engine.plan.num_slots,
                "num_checkpoints": engine.plan.num_checkpoints}


class SimTelemetry(Telemetry):
    """The simulated engine's step records as the run's engine telemetry (no processes to sample)."""

    def __init__(self, server: SimServer, devices: tuple[str, ...]):
        super().__init__(BASE_URL, None, use_nvml=False)
        self.me = None
        self.server, self.devices = server, devices

    def start(self) -> None:
        self.engine_steps = []

    async def stop(self) -> None:
        self.engine_steps = list(self.server.steps)

    def hardware(self) -> dict:
        return {"gpus": list(self.devices), "server_pid": None}


class SimulatedServer:
    """One simulated `flashlane serve`: its engine (and prefix cache) lasts across every load point
    or round run against it, as a real server's does, and its time only moves forward: each run
    starts where the last one ended. ``harness()`` is what ``bench.runner.run_point`` takes."""

    def __init__(self, setup: SimSetup):
        self.setup = setup
        self.engine = setup.engine()
        self.info = setup.server_info(self.engine)
        self.clock = 0.0            # where the last run's virtual time stopped
        self._server: SimServer | None = None

    def retime(self, setup: SimSetup) -> None:
        """Price the next runs with ``setup``'s step costs and front end (the machine's speed
        beside another measured run), keeping the engine and its caches."""
        if (setup.model, setup.cfg, setup.engine_args) != (self.setup.model, self.setup.cfg, self.setup.engine_args):
            raise ValueError("retime: another model or engine arguments than the server's")
        self.setup = setup
        self.engine.cost = setup.cost

    def _client(self) -> httpx.AsyncClient:
        self._server = SimServer(self.engine, self.setup.prompts, self.setup.front_end, self.setup.model, self.info)
        self._server.start()
        return httpx.AsyncClient(transport=self._server, base_url=BASE_URL, timeout=None)

    def _telemetry(self, cfg: BenchConfig, base_url: str) -> Telemetry:
        return SimTelemetry(self._server, self.setup.devices)

    def harness(self) -> Harness:
        manifest = {"simulation": {**self.setup.assumptions, "front_end": self.setup.front_end.to_dict(),
                                   "prompt_tokens": self.setup.prompts.source,
                                   "engine_args": _jsonable(self.setup.engine_args)},
                    "clock": "simulated seconds (virtual time)", "server_command": None}
        return Harness(make_client=self._client, make_telemetry=self._telemetry, run=self._run, manifest=manifest)

    def _run(self, coro):
        async def timed():
            try:
                return await coro
            finally:
                self.clock = asyncio.get_running_loop().time()
        return run_virtual(timed(), start=max(self.clock, self.engine.now))


def simulate_bench(setup: SimSetup, cfg: BenchConfig, out_dir: Path | None = None,
                   resolve_tokenizer=None) -> list[tuple[LoadPoint, dict, Path]]:
    """Every load point of ``cfg`` against one simulated server, as `flashlane bench` runs them
    against one real server; returns bench's [(point, summary, folder)]."""
    check_mode(cfg)
    server = SimulatedServer(setup)
    return run_bench(cfg, out_dir, resolve_tokenizer, harness_for=lambda p: server.harness())


def check_mode(cfg: BenchConfig) -> None:
    if cfg.mode != "recorded":
        raise ValueError("mode: a simulation replays 'recorded' workloads only (it generates no text to feed back)")


def sim_bench_config(**kw) -> BenchConfig:
    """A BenchConfig aimed at the simulated server (telemetry: the simulated step records)."""
    kw.setdefault("base_url", BASE_URL)
    kw.setdefault("telemetry", True)
    return BenchConfig(**kw)


def _jsonable(d: dict) -> dict:
    return {k: (list(v) if isinstance(v, tuple) else v) for k, v in d.items()}
