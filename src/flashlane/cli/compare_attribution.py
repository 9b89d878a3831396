"""What `flashlane compare` needs from outside bench (which speaks HTTP only): a model's role from
its config, `analyze`'s prediction of the replayed trace on the calibrated `local` profile, and
the per-layer-type step profile from `flashlane profile`, run as a subprocess."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

from ..analyze import Hardware, Roofline, Setup, TaskProfile, resolve_model
from ..analyze.task import Turn
from ..bench.layer_profile import has_layer_table
from ..config import ConfigError


def role_of(model: str) -> str | None:
    """'hybrid' when the model's config has linear-attention (KDA) layers, 'standard' when it has
    none, None when no config can be read (a URL, an unknown name)."""
    try:
        cfg = resolve_model(model).cfg
    except (ConfigError, ValueError, OSError):
        return None
    return "hybrid" if "kda" in cfg.mixer_types else "standard"


def make_predictor(hardware: Hardware, weight_dtype: str = "bf16", kv_dtype: str = "bf16"):
    """(model, replayed turns per task, concurrency) -> mean predicted prefill / decode / task
    seconds per task. The calibrated rates are what this machine reached, so mfu = mbu = 1."""
    setup = Setup(hardware, weight_dtype=weight_dtype, kv_dtype=kv_dtype, mfu=1.0, mbu=1.0)
    roofs: dict[str, Roofline | None] = {}

    def predict(model: str, tasks: list, concurrency: int) -> dict | None:
        if model not in roofs:
            try:
                roofs[model] = Roofline(resolve_model(model).cfg, setup)
            except (ConfigError, ValueError, OSError):
                roofs[model] = None
        roof = roofs[model]
        if roof is None or not tasks:
            return None
        runs = []
        for i, task in enumerate(tasks):
            turns = tuple(Turn(new_tokens=max(n_in - cached, 1), cached=min(cached, n_in), output=n_out)
                          for n_in, cached, n_out in task)
            runs.append(roof.task(TaskProfile(f"task{i}", turns, "replayed"), concurrency))
        n = len(runs)
        return {"prefill_s": sum(r["prefill_s"] for r in runs) / n,
                "decode_s": sum(r["decode_s"] for r in runs) / n,
                "task_s": sum(r["latency_s"] for r in runs) / n, "tasks": n,
                "hardware": hardware.name, "setup": {"weight_dtype": weight_dtype, "kv_dtype": kv_dtype,
                                                     "mfu": 1.0, "mbu": 1.0}}

    return predict


CALIBRATION_RUNS = 5
# max/min - 1 of the repeated rates beyond which no prediction is made. Sub-second rates on these
# shared VMs swing 20-50% between runs on an idle machine (another guest's burst), so the peak
# over the runs is used and only a wider spread refuses.
CALIBRATION_MAX_SPREAD = 0.6


def calibrate(runs: int = CALIBRATION_RUNS, measure=None, log=print) -> tuple[Hardware | None, dict]:
    """This machine's `local` profile, measured `runs` times beside a co-tenant monitor: (the
    peak rates over the runs, or None when the machine was busy or the runs spread too far to
    predict from, and the record of all of it for the report)."""
    from dataclasses import replace
    from ..analyze.hardware import calibrate_local
    from ..bench.machine_load import COTENANT_NOISY_FRACTION, cotenant_cpu

    measure = measure or calibrate_local
    with cotenant_cpu() as busy:  # the calibration runs in child processes, counted as ours
        profiles = [measure() for _ in range(runs)]
    rates = [[p.mem_bw for p in profiles]] + [[p.peak_flops[k] for p in profiles]
                                              for k in profiles[0].peak_flops if all(p.peak_flops.get(k) for p in profiles)]
    spread = max(max(r) / min(r) - 1.0 for r in rates if min(r) > 0)
    chosen = replace(profiles[0], mem_bw=max(p.mem_bw for p in profiles),
                     peak_flops={k: max(p.peak_flops[k] for p in profiles) for k in profiles[0].peak_flops},
                     note=profiles[0].note + f"; peak of {runs} runs")
    cotenant = busy["cotenant_cpu_percent"]
    reasons = []
    if cotenant > COTENANT_NOISY_FRACTION * 100 * busy["cores"]:
        reasons.append(f"co-tenants used {cotenant:.0f}% CPU while it ran")
    if spread > CALIBRATION_MAX_SPREAD:
        reasons.append(f"the {runs} runs spread {100 * spread:.0f}%")
    record = {**chosen.to_dict(), "calibration": {
        "runs": runs, "spread": spread, "cotenant_cpu_percent": cotenant, "idle": not reasons,
        "reasons": reasons, "profiles": [p.to_dict() for p in profiles]}}
    if reasons:
        log("calibration not used for predictions: " + "; ".join(reasons))
        return None, record
    return chosen, record


def profile_available() -> bool:
    return importlib.util.find_spec("flashlane.cli.profile") is not None


def find_summary(folder: Path) -> dict | None:
    """The profile command's JSON summary in `folder`: the first JSON document with a layer table."""
    for f in sorted(folder.rglob("*.json")):
        try:
            doc = json.loads(f.read_text())
        except (OSError, ValueError):
            continue
        if has_layer_table(doc):
            return doc
    return None


def make_profiler(out_dir: Path, steps: int = 2, timeout_s: float = 300.0, log=print):
    """(model, batch, context) -> `flashlane profile` JSON summary; None when the command is not
    installed. A failed profile is logged and gives None (the comparison still stands)."""
    if not profile_available():
        return None

    def profile(model: str, batch: int, context: int, dtype: str | None = None) -> dict | None:
        if role_of(model) is None:  # no config to run it from (another server's model name)
            return None
        folder = Path(out_dir) / "profile" / Path(model).name
        cmd = [sys.executable, "-m", "flashlane.cli.main", "profile", model, "--batch", str(batch),
               "--context", str(context), "--steps", str(steps), "--output-dir", str(folder)]
        if dtype in ("float32", "bfloat16"):  # the weights' dtype the measured server ran
            cmd += ["--dtype", dtype]
        try:
            r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
        except (subprocess.SubprocessError, OSError) as exc:
            log(f"profile of {model} failed: {exc}")
            return None
        if r.returncode != 0:
            log(f"profile of {model} failed (exit {r.returncode}): {r.stderr.strip()[-500:]}")
            return None
        return find_summary(folder)

    return profile
