"""A step-cost calibration on disk: the fitted coefficients of one model on one machine in one
engine mode, with the machine, the mode, the grid it was measured on and the fit's residuals.

A calibration only describes the machine, code and mode it was measured in, so reading one checks
them: another CPU model or vector capability, other engine code (``machine.engine_code``: the
engine's, models' and kernels' sources), or another engine mode (dtype, kv-cache dtype,
quantisation, static graphs, kernel backend, threads, speculative decoding's method and draft
count), is refused naming the field, unless the caller asks only for warnings. Within one machine
and mode its speed still drifts; ``speed_probes`` (taken after each chunk size's grid) let a
simulation beside a later measurement scale the costs to that run's speed. A file written by
a newer schema is always refused. A calibration measured without speculative decoding has no
drafting terms; they read as zero (its steps had no drafts to price), as do terms added to the
model after the file was written (``step_cost.LATER_TERMS``: its fit had none).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

from ..config import ModelConfig
from .step_cost import DRAFT_TERMS, LATER_TERMS, TERMS, StepCostModel, StepWork

SCHEMA = 1
# a different value: another machine, or other engine code (the step costs were not its)
MACHINE_KEYS = ("cpu_model", "cpu_capability", "cuda", "engine_code")
MODE_KEYS = ("dtype", "kv_cache_dtype", "quantization", "compile", "kernel_backend", "num_threads",
             "linear_kernel", "speculative")


@dataclass(frozen=True)
class Calibration:
    model: str
    machine: dict
    mode: dict
    peak_flops: float
    mem_bw: float
    weight_dtype: str               # the step-cost model's weight dtype (fp32, bf16, int8)
    kv_dtype: str
    coefficients: dict
    fit: dict                       # residuals: median / p90 relative error, overall and by step kind
    grid: dict
    seconds: float                  # how long the calibration took
    schema: int = SCHEMA
    notes: list = field(default_factory=list)
    front_end: dict | None = None   # the server's host time outside steps (simulate.front_end), when measured
    speed_probes: list | None = None  # the machine's speed while the grid ran (simulate.speed_probe), when taken

    def cost_model(self, cfg: ModelConfig) -> StepCostModel:
        work = StepWork(cfg, self.weight_dtype, self.kv_dtype, graphs=bool(self.mode.get("compile")))
        return StepCostModel(work, self.peak_flops, self.mem_bw, self.coefficients)

    def to_dict(self) -> dict:
        return asdict(self)

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=2) + "\n")


def _mismatches(want: dict, have: dict, keys: tuple[str, ...], what: str) -> list[str]:
    return [f"{what} {k}: the calibration has {have.get(k)!r}, this run has {want[k]!r}"
            for k in keys if k in want and want[k] != have.get(k)]


def load_calibration(path: str | Path, machine: dict | None = None, mode: dict | None = None,
                     strict: bool = True) -> tuple[Calibration, list[str]]:
    """Read a calibration; compare it with this ``machine`` / ``mode`` when given. Mismatches are a
    ValueError naming each field (``strict``) or returned as warnings."""
    try:
        raw = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"calibration {path}: cannot read it ({exc})") from None
    if not isinstance(raw, dict):
        raise ValueError(f"calibration {path}: expected a JSON object")
    schema = raw.get("schema")
    if not isinstance(schema, int) or schema > SCHEMA:
        raise ValueError(f"calibration {path}: schema {schema!r} is newer than this flashlane reads ({SCHEMA}); "
                         "upgrade flashlane or calibrate again")
    try:
        cal = Calibration(**{k: raw[k] for k in Calibration.__dataclass_fields__ if k in raw})
    except TypeError as exc:
        raise ValueError(f"calibration {path}: missing field ({exc})") from None
    if not cal.mode.get("speculative"):
        cal.coefficients.update({t: 0.0 for t in DRAFT_TERMS if t not in cal.coefficients})
    cal.coefficients.update({t: 0.0 for t in LATER_TERMS if t not in cal.coefficients})
    missing = [t for t in TERMS if t not in cal.coefficients]
    if missing:
        raise ValueError(f"calibration {path}: coefficients lack {', '.join(missing)}")
    problems = (_mismatches(machine or {}, cal.machine, MACHINE_KEYS, "machine")
                + _mismatches(mode or {}, cal.mode, MODE_KEYS, "engine mode"))
    if problems and strict:
        raise ValueError(f"calibration {path} does not describe this run: " + "; ".join(problems)
                         + " (calibrate again on this machine and mode)")
    return cal, problems
