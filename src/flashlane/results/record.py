"""Register a finished run in the store from what it wrote to disk: every folder holding a
bench point (`summary.json` beside `manifest.json`), so bench, compare and tune share one path
and the store does not depend on how a command lays out its output."""

from __future__ import annotations

import json
from pathlib import Path

from .store import PointIn, ResultsStore

RUN_SUMMARY_FILES = ("sweep_summary.json", "compare.json", "tune.json")


def point_dirs(out_dir: Path) -> list[Path]:
    """Folders under `out_dir` (itself included) that hold one measured point."""
    out_dir = Path(out_dir)
    return sorted(p.parent for p in out_dir.rglob("summary.json") if (p.parent / "manifest.json").is_file())


def workload_name(spec: dict | None) -> str | None:
    """'agentic/small', 'agentic/trace:file.json', 'fixed', ... from a manifest's workload spec."""
    if not spec:
        return None
    name = spec.get("workload") or spec.get("name")
    if spec.get("trace_file"):
        return f"{name}/trace:{Path(str(spec['trace_file'])).name}"
    return f"{name}/{spec['scale']}" if spec.get("scale") else name


def stack_name(manifest: dict) -> str | None:
    """Which server answered: the `owned_by` of its /v1/models card (flashlane, vllm, sglang)."""
    data = (manifest.get("server_models") or {}).get("data") or []
    return data[0].get("owned_by") if data and isinstance(data[0], dict) else None


def _joined(values) -> str | None:
    vals = sorted({v for v in values if v})
    return ",".join(vals) if vals else None


def record_run(db_path: str | Path, kind: str, out_dir: str | Path,
               targets: list[tuple[str, Path]] | None = None, argv: list[str] | None = None) -> int:
    """Record the run whose output is `out_dir`. `targets`: (name, point folder) pairs to record;
    default: every point folder found, named by its path below `out_dir` (the model for a single
    point). Returns the run id."""
    out_dir = Path(out_dir)
    named = targets is not None  # named points are labelled by their load point, not their folder
    if targets is None:
        targets = []
        for d in point_dirs(out_dir):
            rel = d.relative_to(out_dir).parts
            targets.append(("/".join(rel[:-1]) if len(rel) > 1 else "", d))
    points, manifests = [], []
    for name, d in targets:
        manifest = json.loads((Path(d) / "manifest.json").read_text())
        summary = json.loads((Path(d) / "summary.json").read_text())
        manifests.append(manifest)
        label = _label(summary) if named or Path(d) == out_dir else Path(d).name
        points.append(PointIn(name or manifest.get("model") or "?", label, summary))
    if not points:
        raise ValueError(f"record: no measured point (summary.json + manifest.json) under {out_dir}")
    run_summary = {f: json.loads((out_dir / f).read_text()) for f in RUN_SUMMARY_FILES if (out_dir / f).is_file()}
    first = manifests[0]
    manifest = {"argv": argv if argv is not None else first.get("argv"), "git_sha": first.get("git_sha"),
                "points": {f"{p.target}/{p.label}": m for p, m in zip(points, manifests)}}
    with ResultsStore(db_path) as store:
        return store.record(kind, points, manifest, run_summary,
                            model=_joined(m.get("model") for m in manifests),
                            workload=_joined(workload_name(m.get("workload")) for m in manifests),
                            stack=_joined(stack_name(m) for m in manifests), output_dir=str(out_dir.resolve()))


def _label(summary: dict) -> str:
    lp = summary.get("load_point") or {}
    if lp.get("concurrency") is not None:
        return f"c{lp['concurrency']}"
    return f"r{lp['request_rate']:g}" if lp.get("request_rate") is not None else "run"
