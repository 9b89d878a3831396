"""One measurement: start a server with a configuration, run one bench load point against it over
HTTP, stop it. Any way the configuration can fail (the server does not start, dies mid-run, or
answers too many requests with errors) raises `TrialFailed` with the reason and the log tail."""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable

from flashlane.bench.load import LoadPoint
from flashlane.bench.replay import BenchAbort
from flashlane.bench.runner import BenchConfig, run_point
from flashlane.bench.server_launch import ServerProcess, ServerStartError, free_port
from flashlane.bench.text_synth import TextSynth
from flashlane.bench.workloads.source import WorkloadSource
from flashlane.results.metrics import extract


class TrialFailed(RuntimeError):
    def __init__(self, reason: str, log_tail: str = ""):
        super().__init__(reason)
        self.reason, self.log_tail = reason, log_tail


@dataclass
class Bench:
    """The fixed half of every measurement: workload, load point, bench settings."""
    cfg: BenchConfig
    source: WorkloadSource
    point: LoadPoint
    make_synth: Callable[[], TextSynth]  # called once, after the first server is up (it may create a preset)
    startup_timeout_s: float = 600.0
    synth: TextSynth | None = None

    def prompt_synth(self) -> TextSynth:
        if self.synth is None:
            self.synth = self.make_synth()
        return self.synth


@dataclass
class Measurement:
    summary: dict
    metrics: dict[str, tuple]  # name -> (value, ci_low, ci_high)
    run_dir: Path
    command: list[str]


def measure(target, params: dict, bench: Bench, run_dir: Path, on_status=lambda s: None) -> Measurement:
    port = free_port()
    command = target.command(params, port)
    server = ServerProcess(command, f"http://127.0.0.1:{port}", run_dir / "server.log", bench.startup_timeout_s)
    try:
        on_status("starting server")
        try:
            server.start()
        except ServerStartError as e:
            raise TrialFailed(str(e).split("\n--- log tail ---")[0], server.log_tail()) from None
        cfg = replace(bench.cfg, base_url=server.base_url, model=target.served_model, server_pid=server.pid,
                      server_command=command, output_dir=str(run_dir), progress=False)
        on_status("measuring")
        try:
            summary = run_point(cfg, bench.source, bench.prompt_synth(), bench.point, run_dir)
        except BenchAbort as e:
            raise TrialFailed(_died(server) or f"bench aborted: {e}", server.log_tail()) from None
        died = _died(server)
        if died:
            raise TrialFailed(died, server.log_tail())
        errors = summary["errors"]
        if errors["rate"] > cfg.max_error_rate:
            kinds = ", ".join(f"{k}: {n}" for k, n in errors["by_class"].items())
            raise TrialFailed(f"error rate {errors['rate']:.3f} > {cfg.max_error_rate} ({kinds})",
                              server.log_tail())
        if not summary["sessions"]["completed"]:
            raise TrialFailed("no task finished inside the trial (raise --duration or lower the load)",
                              server.log_tail())
        return Measurement(summary, extract(summary), run_dir, command)
    finally:
        server.stop()


def _died(server: ServerProcess) -> str | None:
    code = server.proc.poll() if server.proc else None
    if code is None:
        return None
    how = f"killed by signal {-code}" if code < 0 else f"exited with code {code}"
    return f"server {how} during the trial (crash or out of memory)"
