"""The simulated side of `flashlane compare` (bench.compare.Simulator): each measured `flashlane
serve` side replayed in simulated time, and the counterfactual waterfall.

Per model and engine mode a step-cost calibration of this machine is needed; one made earlier
for this CPU and mode is reused from the calibration cache (``$FLASHLANE_CACHE/calibrations``),
else `flashlane calibrate` runs once (a grid sized for the compare workload: prompts up to 8K
tokens, batches of 1 and 4 (and the workload's concurrency) of at most 16K prompt tokens, two chunk
sizes; its residuals are logged). A side's simulation
replays the rounds the side measured, in order, against one simulated server per (stack, model),
so the simulated tasks are the measured ones; its errors against the measurement and the step-cost
model's error on the measured step records are stored with the run.

The machine's speed drifts between the calibration and the run (``simulate.speed_probe``): before
every measured round and after the last this process takes a speed probe in the servers' dtype and
thread count, and a side is simulated at the speed the probes on either side of its rounds show
against its calibration's (``drift``); the figures as calibrated (no drift applied) are stored
beside them.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

from .. import presets
from ..analyze.calibration import Calibration, load_calibration
from ..analyze.models import resolve_model
from ..analyze.step_cost import StepShape, error_summary
from ..bench.attribution import read_steps
from ..bench.compare_runs import CompareTarget, PointRun, StackRun, safe_name
from ..bench.runner import BenchConfig
from ..bench.stats import keyed_ratio
from ..simulate.front_end import FrontEnd
from ..simulate.rounds import replay_rounds, round_controls
from ..simulate.run import BASE_URL, SimulatedServer
from ..simulate.setup import calibrated
from ..simulate.speed_probe import Drift, SpeedProbe, drift, measure_speed
from .calibrate import CALIBRATION_METHOD, FOLLOW_UP_TOKENS
from .engine_flags import engine_kwargs_of_flags, flags_of_engine_kwargs

# the calibration grid compare runs when no calibration of this machine and mode is cached:
# "compare" reaches the contexts of the long workload; "quick" is a smoke run (tests, a first look)
CALIBRATION_GRIDS = {"compare": ["--chunks", "512,2048", "--batches", "1,4", "--contexts", "512,2048,8192",
                                 "--batch-tokens", "16384"],
                     "quick": ["--quick"]}
CALIBRATION_TIMEOUT_S = 3600.0


def grid_args(grid: str, max_batch: int = 1) -> list[str]:
    """``calibrate``'s arguments for a named grid, its decode batches reaching ``max_batch`` (the
    highest concurrency the simulated workload runs at: a fit never extrapolates in batch)."""
    args = list(CALIBRATION_GRIDS[grid])
    if "--batches" in args:
        i = args.index("--batches") + 1
        batches = {int(b) for b in args[i].split(",")} | {max_batch}
        args[i] = ",".join(str(b) for b in sorted(batches))
    return args


MODE_KEYS = ("dtype", "kv_cache_dtype", "quantization", "compile", "num_threads", "linear_kernel")


def _metric(summary: dict, path: tuple[str, ...]):
    v = summary
    for k in path:
        v = v.get(k) if isinstance(v, dict) else None
    return v if isinstance(v, (int, float)) else None


# figure -> where bench's summary keeps it, and whether its error is relative (else absolute)
FIGURES = {"task_s": (("task_latency_s", "mean"), True), "task_p90_s": (("task_latency_s", "p90"), True),
           "tasks_per_hour": (("tasks_per_hour",), True), "ttft_s": (("ttft_s", "mean"), True),
           "itl_s": (("itl_s", "mean"), True), "prefix_hit": (("cache", "prefix_cache_hit_rate"), False)}


def figures(measured: dict, simulated: dict) -> dict:
    """Each figure measured and simulated, with the simulation's error (relative, or absolute for
    the prefix-cache hit rate)."""
    out = {}
    for name, (path, relative) in FIGURES.items():
        m, s = _metric(measured, path), _metric(simulated, path)
        err = None
        if m is not None and s is not None:
            err = (s - m) / m if relative and m else (s - m if not relative else None)
        out[name] = {"measured": m, "simulated": s, "error": err, "relative": relative}
    return out


def per_step_error(cal: Calibration, model: str, run_dirs: list[Path], speed: Drift | None = None) -> dict | None:
    """The step-cost model against every step record the measured rounds hold (so errors cannot
    cancel between prefill and decode), each step priced as the simulation prices a served one
    (the calibration's served-step scales, at the ``speed`` drift when given): median and p90
    |predicted - measured| / measured."""
    shapes, seconds = [], []
    for d in run_dirs:
        for rec in read_steps(d) or []:
            if rec.get("seq_new_tokens") and rec["end"] > rec["start"]:
                shapes.append(StepShape.from_record(rec))
                seconds.append(rec["end"] - rec["start"])
    if not shapes:
        return None
    cost = cal.cost_model(resolve_model(model).cfg)
    served = FrontEnd.from_dict(cal.front_end).served((speed.scale_cost(cost) if speed else cost).seconds)
    return error_summary(served, shapes, seconds)


class LocalSimulator:
    def __init__(self, serve_args: list[str], out_dir: Path, log=print, cache_dir: Path | None = None,
                 grid: str = "compare", max_batch: int = 1):
        from ..machine import machine_info

        self.serve_args = list(serve_args)      # equal conditions (+ --serve-arg), before each stack's flags
        self.out_dir = Path(out_dir)
        self.log = log
        if grid not in CALIBRATION_GRIDS:
            raise ValueError(f"calibration grid: expected one of {', '.join(CALIBRATION_GRIDS)}, got {grid!r}")
        self.grid_args = grid_args(grid, max_batch)
        self.cache_dir = Path(cache_dir) if cache_dir else presets.cache_dir() / "calibrations"
        self.machine = machine_info()
        self.defaults = engine_kwargs_of_flags([])
        self.calibrations: dict[str, dict] = {}      # for the report: file -> what it says
        self._cals: dict[tuple, Calibration | None] = {}
        self._servers: dict[tuple, SimulatedServer] = {}
        kw = engine_kwargs_of_flags(self.serve_args, "compare's server flags")
        # the probes run as the servers' engines do ("auto": what a calibration on this CPU resolves)
        self.probe_dtype = kw["dtype"] if kw["dtype"] != "auto" else "float32"
        self.probe_threads = kw["num_threads"] or 1
        self.probes: dict[tuple[str, str, int], SpeedProbe] = {}    # (stack, load, schedule position) -> probe

    # ---- engine arguments and calibrations -------------------------------------------------
    def engine_args(self, flags: list[str]) -> dict:
        """What `flashlane serve` runs with for the equal-condition args then a stack's flags
        (only those off the default)."""
        kw = engine_kwargs_of_flags(self.serve_args + list(flags), "compare's server flags")
        return {k: v for k, v in kw.items() if v != self.defaults[k]}

    def calibration(self, model: str, args: dict) -> tuple[Calibration | None, str | None]:
        mode = {k: args.get(k, self.defaults[k]) for k in MODE_KEYS}
        if mode["compile"] or mode["quantization"]:
            mode["linear_kernel"] = "aten"          # what such an engine runs whatever it was asked
        elif mode["linear_kernel"] == "auto":
            del mode["linear_kernel"]               # resolved by the calibration's own engine
        key = (model, *(str(mode.get(k)) for k in MODE_KEYS))
        if key in self._cals:
            return self._cals[key]
        grid = [*self.grid_args, *FOLLOW_UP_TOKENS, CALIBRATION_METHOD]     # a changed grid is calibrated anew
        tag = hashlib.sha256(json.dumps([self.machine["cpu_model"], self.machine["cpu_capability"], mode, grid],
                                        sort_keys=True).encode()).hexdigest()[:12]
        path = self.cache_dir / f"{safe_name(model)}-{tag}.json"
        cal = self._load(path, mode)
        if cal is None:
            cal = self._calibrate(model, mode, path)
        if cal is not None:
            (self.out_dir / "calibrations").mkdir(parents=True, exist_ok=True)
            shutil.copy(path, self.out_dir / "calibrations" / path.name)
            self.calibrations[path.name] = {"model": model, "mode": cal.mode, "fit": cal.fit.get("by_kind"),
                                            "cross_validated": cal.fit.get("cross_validated"),
                                            "front_end": cal.front_end, "machine": cal.machine.get("cpu_model")}
        self._cals[key] = (cal, str(path) if cal else None)
        return self._cals[key]

    def _load(self, path: Path, mode: dict) -> Calibration | None:
        if not path.is_file():
            return None
        want = {k: v for k, v in mode.items() if k != "kv_cache_dtype"}   # auto: resolved by the calibration
        try:
            cal, _ = load_calibration(path, machine=self.machine, mode=want, strict=True)
        except ValueError as exc:
            self.log(f"calibration {path} not reused: {exc}")
            return None
        self.log(f"reusing the calibration {path}")
        return cal

    def _calibrate(self, model: str, mode: dict, path: Path) -> Calibration | None:
        path.parent.mkdir(parents=True, exist_ok=True)
        flags = flags_of_engine_kwargs({k: v for k, v in mode.items() if v is not None})
        cmd = [sys.executable, "-m", "flashlane.cli.main", "calibrate", model, *flags, *self.grid_args,
               "--out", str(path)]
        self.log(f"calibrating {model} for the simulation: {' '.join(cmd[3:])}")
        try:
            r = subprocess.run(cmd, capture_output=True, text=True, timeout=CALIBRATION_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self.log(f"calibration of {model} took over {CALIBRATION_TIMEOUT_S:.0f} s: no simulation for it")
            return None
        if r.returncode != 0:
            self.log(f"calibration of {model} failed (no simulation for it): {r.stderr.strip()[-800:]}")
            return None
        for line in r.stdout.splitlines():
            self.log("  " + line)
        return load_calibration(path)[0]

    def drift(self, cal: Calibration, probes: list[SpeedProbe]) -> tuple[Drift | None, str | None]:
        """The machine's speed during ``probes`` against ``cal``'s."""
        try:
            then = [SpeedProbe.from_dict(p) for p in cal.speed_probes or []]
        except ValueError as exc:
            return None, f"the calibration's {exc}"
        return drift(probes, then)

    def setup(self, model: str, args: dict, zero_host: bool = False, probes: list[SpeedProbe] | None = None):
        """A simulated server of ``model`` with ``args``, at the speed ``probes`` show (all taken so
        far when None) against its calibration's."""
        cal, _ = self.calibration(model, args)
        if cal is None:
            return None
        speed, _ = self.drift(cal, list(self.probes.values()) if probes is None else probes)
        return calibrated(model, cal, args, self.machine, zero_host, speed)[0]

    # ---- speed probes ----------------------------------------------------------------------
    def between_rounds(self, stack: str, load: str, position: int) -> None:
        self.probes[(stack, load, position)] = measure_speed(self.probe_dtype, self.probe_threads)

    def round_probes(self, stack: str, load: str, rounds) -> list[SpeedProbe]:
        """The probes just before and just after each of ``rounds`` (``bench.rounds.RoundRun``):
        the machine's speed on either side of it (transient slowdowns of a few seconds are common
        here, so one probe per round samples them too coarsely)."""
        keys = sorted({(stack, load, p) for rr in rounds for p in (rr.position, rr.position + 1)})
        return [self.probes[k] for k in keys if k in self.probes]

    # ---- Simulator -------------------------------------------------------------------------
    def beside(self, group: StackRun, target: CompareTarget, run: PointRun, cfg: BenchConfig, source, synth,
               folder: Path) -> dict | None:
        args = self.engine_args(group.flags.get(target.name, []))
        if _measured_acceptance(args):
            self.log(f"simulate: stack {group.name} decodes speculatively at the acceptance its weights give, which "
                     "the simulated server cannot know (give it synthetic_acceptance_length to simulate it): no "
                     "simulated figures beside it")
            return None
        cal, path = self.calibration(target.model, args)
        if cal is None:
            return None
        probes = self.round_probes(group.name, run.point.label, run.rounds)
        speed, why = self.drift(cal, probes)
        if speed is None:
            self.log(f"simulate: {group.name} {target.name} {run.point.label} at the calibration's speed ({why})")
        rounds = [rr.run_dir for rr in run.rounds]

        def replay(drifted: bool, where: Path):
            setup = calibrated(target.model, cal, args, self.machine, drift=speed if drifted else None)[0]
            key = (group.name, target.name, drifted)
            if key in self._servers:
                self._servers[key].retime(setup)    # this load point's rounds ran at their own speed
            else:
                self._servers[key] = SimulatedServer(setup)
            server = self._servers[key]
            return replay_rounds(server, _sim_cfg(cfg), source, synth, run.point, round_controls(rounds), where)

        summary, by_tree = replay(True, folder)
        out = {"folder": str(folder), "calibration": path, "task_s_by_tree": by_tree,
               "figures": figures(run.summary, summary),
               "per_step": per_step_error(cal, target.model, rounds, speed),
               "drift": speed.to_dict() if speed else None, "drift_missing": why,
               "probes": [p.to_dict() for p in probes]}
        if speed is not None:
            as_cal, out["task_s_by_tree_as_calibrated"] = replay(False, folder / "as_calibrated")
            out["figures_as_calibrated"] = figures(run.summary, as_cal)
            out["per_step_as_calibrated"] = per_step_error(cal, target.model, rounds)
        return out

    def counterfactuals(self, groups: list[StackRun], targets: list[CompareTarget], source, synth,
                        folder: Path) -> dict | None:
        """From the stack whose measurement reproduces the finding (the hybrid slower; else the
        first), at its first load point: the simulated ratio as measured, then with one more
        mechanism of the flashlane stack each step: prefix caching for the hybrid, continuous
        batching (a 2 ms window), static-graph decode (a calibration in that mode), no host time."""
        hyb = next((t for t in targets if t.role == "hybrid"), None)
        std = next((t for t in targets if t.role == "standard"), None)
        cands = [g for g in groups if g.stack and hyb and std and g.points.get(hyb.name) and g.points.get(std.name)
                 and all(not g.stack.external(t.role) for t in (hyb, std))
                 and not any(_measured_acceptance(self.engine_args(g.flags.get(t.name, []))) for t in (hyb, std))]
        if not cands:
            return None

        def measured_ratio(g: StackRun) -> float:
            a, b = g.points[hyb.name][0].latencies, g.points[std.name][0].latencies
            return (sum(a) / len(a)) / (sum(b) / len(b)) if a and b else 0.0

        base = next((g for g in cands if measured_ratio(g) > 1.0), cands[0])
        args = {t.name: self.engine_args(base.flags.get(t.name, [])) for t in (hyb, std)}
        changes = [("as measured: " + base.name, {}, False)]
        if not args[hyb.name].get("enable_prefix_caching", self.defaults["enable_prefix_caching"]):
            changes.append(("+ prefix caching for the hybrid (state checkpoints)",
                            {hyb.name: {"enable_prefix_caching": True}}, False))
        if any(a.get("scheduler") == "static" or not a.get("max_wait_ms") for a in args.values()):
            changes.append(("+ continuous batching, 2 ms window",
                            {t.name: {"scheduler": "continuous", "max_wait_ms": 2.0} for t in (hyb, std)}, False))
        if not all(a.get("compile", self.defaults["compile"]) for a in args.values()):
            changes.append(("+ static-graph decode", {t.name: {"compile": True} for t in (hyb, std)}, False))
        changes.append(("+ no host time (front end, per-step and dispatch terms zero)", {}, True))
        steps, zero_host, not_simulated = [], False, []
        for label, change, host_off in changes:
            before = dict(args)
            for name, upd in change.items():
                args[name] = {**args[name], **upd}
                if upd.get("scheduler") == "continuous":
                    args[name].pop("static_batch_size", None)
            setups = {t.name: self.setup(t.model, args[t.name], zero_host or host_off) for t in (hyb, std)}
            if None in setups.values():
                if not steps:
                    return None
                # a mode without a calibration (its calibration failed or timed out): the later
                # steps go on without this mechanism, and the report says so
                not_simulated.append(f"{label[2:]}: no calibration of this machine in that mode")
                args = before
                continue
            zero_host = zero_host or host_off
            tasks = {}
            for t in (hyb, std):
                setup = setups[t.name]
                run = base.points[t.name][0]
                _, tasks[t.name] = replay_rounds(SimulatedServer(setup), _sim_cfg(base.cfgs[t.name]), source, synth,
                                                 run.point, round_controls([rr.run_dir for rr in run.rounds]),
                                                 folder / f"step{len(steps)}" / t.name)
            ratio = keyed_ratio(tasks[hyb.name], tasks[std.name])
            steps.append({"change": label, "ratio": ratio,
                          "hybrid_task_s": _mean(tasks[hyb.name].values()),
                          "standard_task_s": _mean(tasks[std.name].values())})
        first = steps[0]["ratio"]
        for prev, step in zip(steps, steps[1:]):
            gap = (first or 0) - 1.0
            step["share_of_gap"] = ((prev["ratio"] - step["ratio"]) / gap
                                    if gap > 0 and prev["ratio"] is not None and step["ratio"] is not None else None)
        return {"stack": base.name, "load": base.points[hyb.name][0].point.label, "hybrid": hyb.name,
                "standard": std.name, "steps": steps, "not_simulated": not_simulated}


def _sim_cfg(cfg: BenchConfig) -> BenchConfig:
    return replace(cfg, base_url=BASE_URL, telemetry=True, progress=False, server_pid=None)


def _mean(xs) -> float | None:
    xs = list(xs)
    return sum(xs) / len(xs) if xs else None


def _measured_acceptance(engine_args: dict) -> bool:
    """Speculative decoding whose acceptance comes from the model (not a synthetic length)."""
    from ..engine.speculative.config import SpeculativeConfig

    spec = SpeculativeConfig.parse(engine_args.get("speculative_config"))
    return spec is not None and not spec.synthetic
