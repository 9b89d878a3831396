"""The rounds a comparison measured, replayed against a simulated server.

A measured side of `flashlane compare` ran its load point in rounds (``bench.rounds``): each round
a bench run with its own first session, session count and warmup, recorded in the round's
manifest. Here the same rounds run in the same order against one ``SimulatedServer`` (its prefix
cache lasting across them, as the real server's did), and are pooled the way the measured side
was (``bench.rounds.merge_side``), so the simulated figures describe exactly the measured tasks.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

from ..bench.load import LoadPoint
from ..bench.records import read_sessions
from ..bench.rounds import RoundRun, merge_side
from ..bench.runner import BenchConfig, run_point
from ..bench.task_components import measured_sessions
from .run import SimulatedServer, check_mode


def round_controls(round_dirs: list[Path]) -> list[dict]:
    """Each measured round's run control (first session, sessions, warmup), from its manifest."""
    out = []
    for d in round_dirs:
        manifest = json.loads((Path(d) / "manifest.json").read_text())
        out.append(manifest["run_control"])
    return out


def replay_rounds(server: SimulatedServer, cfg: BenchConfig, source, synth, point: LoadPoint,
                  controls: list[dict], folder: Path) -> tuple[dict, dict[str, float]]:
    """Run the rounds ``controls`` describe against ``server``; returns the pooled summary (bench's
    schema, written to ``folder``) and each task's latency by tree id."""
    check_mode(cfg)
    rounds, by_tree = [], {}
    for i, rc in enumerate(controls):
        rcfg = replace(cfg, first_session=rc["first_index"], num_sessions=rc["num_sessions"],
                       duration_s=rc["duration_s"], warmup=rc["warmup"], warmup_requests=rc["warmup_requests"])
        run_dir = folder / f"round{i}"
        summary = run_point(rcfg, source, synth, point, run_dir, server.harness())
        measured = measured_sessions(read_sessions(run_dir / "sessions.jsonl"))
        by_tree.update({s.tree_id: s.latency_s for s in measured})
        rounds.append(RoundRun(i, i, server.setup.model, run_dir, summary["window_start"], summary["window_end"],
                               summary, [s.latency_s for s in measured], {}))
    pooled, _, _ = merge_side(cfg, point, rounds, folder)
    return pooled, by_tree
