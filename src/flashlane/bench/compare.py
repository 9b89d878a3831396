"""`flashlane compare`: the same seeded agentic workload on two targets, side by side, under
named serving stacks (bench/stacks.py), with a CI on every ratio and an attributed answer.

A target is a base URL (used as is) or a model id (started here with `flashlane serve` on a free
port and always stopped afterwards). With stacks, each (stack, model) is its own server started
with that stack's flags for the model's role (hybrid or standard); URL targets cannot take stacks,
so then only the given servers run. Both servers of a stack are up together and every load point
is measured in interleaved rounds (bench/rounds.py: the same tasks on A and B back to back, ABBA
order), so the machine's drift hits both sides and each round is one pair for the ratio's CI.
A stack whose command is not `flashlane serve` (a stack file's vLLM or SGLang server) is started
as written; it has no engine step records, so for it only the measured wall-clock figures are
reported, with a note, and neither the simulation nor the local profile is run for it.
Beside each measured `flashlane serve` side a `Simulator` (the CLI wires ``simulate``) replays the
same rounds in simulated time and reports its figures and their error, and simulates the
counterfactuals (one mechanism changed at a time) that the waterfall shows.
The report is written by compare_report.py.
"""

from __future__ import annotations

import contextlib
import functools
import json
import signal
import sys
from dataclasses import replace
from pathlib import Path
from typing import Callable, Protocol

import httpx

from .attribution import mean_partition, run_partitions
from .compare_report import write_compare
from .compare_runs import CompareTarget, PointRun, StackRun, is_url, safe_name
from .load import LoadPoint
from .machine_load import summarize_rounds
from .rounds import merge_side, round_sizes, run_round, schedule
from .runner import BenchConfig, build_source
from .server_launch import ServerProcess, free_port, serve_command
from .stack_files import command_with_env, fill
from .stacks import ROLES, Stack
from .task_components import measured_components, replayed_turns
from .text_synth import TextSynth, TokenizerResolver, load_tokenizer



class Simulator(Protocol):
    calibrations: dict     # what the simulated step costs were fitted on, for the report

    def between_rounds(self, stack: str, load: str, position: int) -> None:
        """Called before the round at ``position`` of a load point's interleaved schedule and once
        after its last (``position`` = the number of rounds), both servers idle: where the
        simulator measures the machine's speed, so each round lies between two measurements."""

    def beside(self, group: StackRun, target: CompareTarget, run: PointRun, cfg: BenchConfig, source, synth,
               folder: Path) -> dict | None:
        """The simulated figures of one measured side (the same rounds replayed in simulated time),
        with their errors against the measurement; None when it cannot simulate this side."""

    def counterfactuals(self, groups: list[StackRun], targets: list[CompareTarget], source, synth,
                        folder: Path) -> dict | None:
        """Simulated ratios with one mechanism changed at a time, from the stack that reproduces
        the finding, at the first load point (the waterfall); None when there is nothing to do."""

# (model id, batch, context, weights dtype as served or None) -> the profile command's JSON summary, or None
Profiler = Callable[[str, int, int, "str | None"], "dict | None"]

__all__ = ["CompareTarget", "assign_roles", "launch_command", "resolve_targets", "run_compare"]


def resolve_targets(a: str, b: str) -> list[CompareTarget]:
    out = []
    for spec in (a, b):
        if is_url(spec):
            out.append(CompareTarget(spec, safe_name(spec), base_url=spec.rstrip("/")))
        else:
            out.append(CompareTarget(spec, safe_name(spec), model=spec))
    if out[0].name == out[1].name:
        out[0].name, out[1].name = out[0].name + "-A", out[1].name + "-B"
    return out


def assign_roles(targets: list[CompareTarget], role_of: Callable[[str], str | None] | None) -> str:
    """Hybrid / standard role of each target: from `role_of(model id)` (the CLI reads the model's
    config: linear-attention layers make it hybrid) when that tells the two apart, else by
    position (A hybrid, B standard). Returns how the roles were decided."""
    found = [role_of(t.model) if role_of and t.model and not is_url(t.spec) else None for t in targets]
    if sorted(r for r in found if r) == sorted(ROLES):
        for t, r in zip(targets, found):
            t.role = r
        return "from the models' configs"
    targets[0].role, targets[1].role = ROLES
    return "by position (A hybrid, B standard)"


def launch_command(t: CompareTarget, port: int, template: str | None, extra_args: list[str],
                   flags: list[str]) -> list[str]:
    """The server command for one (stack, model): a template's command gets the stack flags
    appended; the default `flashlane serve` gets --serve-arg extras, then the stack's flags."""
    if template:
        return serve_command(t.model, port, template) + flags
    return serve_command(t.model, port, None, list(extra_args) + flags)


def stack_command(t: CompareTarget, port: int, s: Stack, template: str | None,
                  extra_args: list[str]) -> list[str]:
    """The server command of stack `s` for target `t`'s role: an external server's template as
    written; `flashlane serve` flags through `launch_command`; either with the stack's env."""
    spec = s.role(t.role)
    if spec.external:
        return command_with_env(spec, serve_command(t.model, port, spec.command))
    values = {"model": t.model, "port": port, "host": "127.0.0.1", "python": sys.executable}
    flags = [fill(f, values) for f in s.flags(t.role)]
    return command_with_env(spec, launch_command(t, port, template, extra_args, flags))


def start_targets(targets: list[CompareTarget], folder: Path, stack: contextlib.ExitStack,
                  template: str | None, extra_args: list[str], startup_timeout_s: float, log,
                  flags: dict[str, list[str]] | None = None, serving: Stack | None = None) -> None:
    """Start each model's server: under stack `serving` when given, else with `flags`."""
    for t in targets:
        if is_url(t.spec):
            continue
        port = free_port()
        own = (flags or {}).get(t.name, [])
        if serving is not None:
            cmd = stack_command(t, port, serving, template, extra_args)
        else:
            cmd = launch_command(t, port, template, extra_args, own)
        t.base_url = f"http://127.0.0.1:{port}"
        if serving is not None and serving.external(t.role):
            log(f"starting {t.model} on port {port} as an external server: {' '.join(cmd)}")
        else:
            log(f"starting {t.model} on port {port}" + (f" with {' '.join(own)}" if own else ""))
        t.server = ServerProcess(cmd, t.base_url, folder / t.name / "server.log", startup_timeout_s)
        stack.callback(t.server.stop)
        t.server.start()
        log(f"{t.model} healthy at {t.base_url} (pid {t.server.pid})")


def served_model(t: CompareTarget) -> str | None:
    if t.model and not is_url(t.spec):
        try:
            data = httpx.get(t.base_url + "/v1/models", timeout=5).json().get("data", [])
            ids = [m.get("id") for m in data]
            if t.model in ids or not ids:
                return t.model
            return ids[0]
        except (httpx.HTTPError, ValueError):
            return t.model
    return None  # URL target: the runner takes the first model it lists


def prompt_synth(cfg: BenchConfig, targets: list[CompareTarget],
                 resolve: TokenizerResolver | None = None) -> tuple[BenchConfig, TextSynth]:
    """One text synthesizer for both targets (identical prompts): the given tokenizer, else the
    first target whose model id is a folder with a tokenizer or a name `resolve` maps to one (the
    CLI's preset resolver; called after the servers are up, as they create presets), else the
    approximation."""
    tok = load_tokenizer(cfg.tokenizer, resolve) if cfg.tokenizer else None
    if tok is None:
        for t in targets:
            if t.model and not is_url(t.spec):
                try:
                    tok = load_tokenizer(t.model, resolve)
                except ValueError:
                    continue
                cfg = replace(cfg, tokenizer=t.model)
                break
    return cfg, TextSynth(seed=cfg.seed, tokenizer=tok)


def measure_interleaved(cfgs: dict[str, BenchConfig], targets: list[CompareTarget], source, synth,
                        point: LoadPoint, folder: Path, log, prefix: str = "",
                        between_rounds: Callable[[str, int], None] | None = None) -> dict[str, PointRun]:
    """One load point on both targets in interleaved rounds; the pooled run of each.
    ``between_rounds(load, position)``: called before each round and after the last (the
    simulator's speed probe)."""
    names = [t.name for t in targets]
    servers = {t.name: t.server.pid if t.server else cfgs[t.name].server_pid for t in targets}
    sizes = round_sizes(cfgs[names[0]], point)
    rounds: dict[str, list] = {n: [] for n in names}
    starts = {0: cfgs[names[0]].first_session}
    for position, (r, name) in enumerate(schedule(names, len(sizes))):
        log(f"{prefix}{name} {point.label} round {r + 1}/{len(sizes)}")
        if between_rounds is not None:
            between_rounds(point.label, position)
        rr, nxt = run_round(cfgs[name], source, synth, point, folder / name / point.label / f"round{r}", r,
                            position, name, starts[r], sizes[r], servers)
        rounds[name].append(rr)
        starts[r + 1] = max(starts.get(r + 1, 0), nxt)
    if between_rounds is not None:
        between_rounds(point.label, len(names) * len(sizes))
    out = {}
    for name in names:
        side = folder / name / point.label
        summary, records, sessions = merge_side(cfgs[name], point, rounds[name], side)
        parts = [p for rr in rounds[name] for p in (run_partitions(rr.run_dir) or [])]
        machine = summarize_rounds([rr.machine for rr in rounds[name]])
        (side / "machine_load.json").write_text(json.dumps(machine, indent=2))
        manifest = dict(summary.get("_manifest") or {})
        manifest["rounds"] = [{"round": rr.index, "position": rr.position, "folder": rr.run_dir.name}
                              for rr in rounds[name]]
        (side / "manifest.json").write_text(json.dumps(manifest, indent=2, default=str))
        out[name] = PointRun(point, summary, side, [x for rr in rounds[name] for x in rr.latencies],
                             measured_components(records, sessions), replayed_turns(records, sessions),
                             machine, rounds[name], mean_partition(parts))
    return out


def run_compare(a: str, b: str, base_cfg: BenchConfig, out_dir: Path, template: str | None = None,
                extra_args: list[str] | None = None, startup_timeout_s: float = 300.0,
                log=print, resolve_tokenizer: TokenizerResolver | None = None,
                stacks: list[Stack] | None = None, role_of: Callable[[str], str | None] | None = None,
                simulator: Simulator | None = None, profile: Profiler | None = None,
                conditions: dict | None = None) -> dict:
    """Run the comparison under each stack (None or URL targets: the servers as given); returns
    {'rows', 'explanation', 'answer', 'markdown', ...}. `resolve_tokenizer`: see `prompt_synth`;
    `role_of`: see `assign_roles`; `simulator` / `profile`: attribution hooks (the CLI wires
    `simulate` and `flashlane profile`); `conditions`: what the caller resolved once for both
    servers (dtype, threads), for the report."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    targets = resolve_targets(a, b)
    roles_how = assign_roles(targets, role_of)
    if stacks and any(is_url(t.spec) for t in targets):
        log("compare: URL targets cannot take stacks; only the given servers run")
        stacks = None
    groups = ([StackRun(s.name, s, {t.name: s.flags(t.role) for t in targets}) for s in stacks]
              if stacks else [StackRun("as given", None)])
    source = build_source(base_cfg)
    synth = None
    previous = signal.getsignal(signal.SIGTERM)

    def on_term(*_):
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_term)
    try:
        for g in groups:
            folder = out_dir / g.name if g.stack else out_dir
            g.points = {t.name: [] for t in targets}
            with contextlib.ExitStack() as servers:
                if g.stack:
                    log(f"stack {g.name}")
                start_targets(targets, folder, servers, template, extra_args or [], startup_timeout_s,
                              log, g.flags, g.stack)
                if synth is None:
                    base_cfg, synth = prompt_synth(base_cfg, targets, resolve_tokenizer)
                cfgs = {t.name: replace(base_cfg, base_url=t.base_url, model=served_model(t),
                                        server_pid=t.server.pid if t.server else base_cfg.server_pid,
                                        server_command=t.server.command if t.server else None)
                        for t in targets}
                g.cfgs = cfgs
                for point in base_cfg.load_points():
                    runs = measure_interleaved(cfgs, targets, source, synth, point, folder, log,
                                               f"{g.name} " if g.stack else "",
                                               None if simulator is None else functools.partial(
                                                   simulator.between_rounds, g.name))
                    for t in targets:
                        g.points[t.name].append(runs[t.name])
    finally:
        signal.signal(signal.SIGTERM, previous)
    attribution = attribute(targets, groups, profile, out_dir, log) + external_notes(targets, groups)
    counterfactual = None
    if simulator is not None:
        simulate_beside(simulator, targets, groups, source, synth, out_dir, log)
        counterfactual = simulator.counterfactuals(groups, targets, source, synth, out_dir / "simulated")
    return write_compare(targets, groups, base_cfg, out_dir, roles_how, attribution,
                         simulator.calibrations if simulator else None, conditions, counterfactual)


def external_notes(targets: list[CompareTarget], groups: list[StackRun]) -> list[str]:
    """One sentence per stack with an external (not `flashlane serve`) server."""
    lines = []
    for g in groups:
        ext = [t.name for t in targets if g.stack and not is_url(t.spec) and g.stack.external(t.role)]
        if ext:
            lines.append(f"{g.name} runs {' and '.join(ext)} on an external server (not `flashlane serve`): "
                         f"only the measured wall-clock figures are shown there; engine-side attributions "
                         f"(engine busy time, step records, the per-task partition, the simulation beside "
                         f"it and the profile) are unavailable.")
    return lines


def _flashlane_side(g: StackRun, t: CompareTarget) -> bool:
    return not (g.stack and g.stack.external(t.role))


def simulate_beside(simulator: Simulator, targets, groups: list[StackRun], source, synth, out_dir: Path,
                    log) -> None:
    """The simulated figures of every measured `flashlane serve` side, stored on its runs."""
    for g in groups:
        for t in targets:
            if not t.model or is_url(t.spec) or not _flashlane_side(g, t):
                continue
            for pr in g.points.get(t.name) or []:
                folder = out_dir / "simulated" / (g.name if g.stack else "as-given") / t.name / pr.point.label
                log(f"simulating {g.name} {t.name} {pr.point.label}")
                pr.simulated = simulator.beside(g, t, pr, g.cfgs[t.name], source, synth, folder)


def attribute(targets, groups: list[StackRun], profile: Profiler | None, out_dir: Path, log) -> list[str]:
    """One per-layer-type profile sentence per model at the workload's batch and median final
    context."""
    from .layer_profile import breakdown_sentence

    lines: list[str] = []
    if profile is None:
        return lines
    for t in targets:
        if not t.model or is_url(t.spec):
            continue
        runs = [pr for g in groups if _flashlane_side(g, t) for pr in g.points.get(t.name, [])]
        contexts = [max(i + o for i, _, o in task) for pr in runs for task in pr.turns if task]
        if not contexts:
            continue
        batch = max(pr.point.concurrency or 1 for pr in runs)
        context = sorted(contexts)[len(contexts) // 2]  # a typical task's final context
        dtype = next((pr.summary.get("server_info", {}).get("dtype") for pr in runs), None)
        log(f"profiling {t.model} at batch {batch}, context {context}" + (f", {dtype} as served" if dtype else ""))
        doc = profile(t.model, batch, context, dtype)
        if doc is None:
            continue
        (out_dir / "profile").mkdir(exist_ok=True)
        (out_dir / "profile" / f"{t.name}.json").write_text(json.dumps(doc, indent=2))
        try:
            lines.append(breakdown_sentence(t.name, {"batch": batch, "context": context, **doc}))
        except ValueError as exc:
            lines.append(f"The profile of {t.name} could not be read: {exc}.")
    return lines
