"""Markdown reports: one run, and a sweep over load points."""

from __future__ import annotations

from .report_rows import load_label, run_rows, sweep_rows


def md_table(head: list[str], rows: list[list[str]]) -> str:
    esc = lambda x: str(x).replace("|", "\\|")  # noqa: E731
    lines = ["| " + " | ".join(map(esc, head)) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(map(esc, r)) + " |" for r in rows]
    return "\n".join(lines)


def render_run(summary: dict, manifest: dict) -> str:
    w = manifest.get("workload", {})
    title = (f"# flashlane bench — {w.get('workload', '?')} on {manifest.get('model')} "
             f"({load_label(summary['load_point'])})")
    meta = (f"target `{manifest.get('base_url')}`, mode `{summary['mode']}`, seed {manifest.get('seed')}, "
            f"endpoint `{manifest.get('endpoint')}`, tokenizer `{manifest.get('tokenizer')}`")
    return "\n\n".join([title, meta, md_table(["metric", "value"], [list(r) for r in run_rows(summary)])]) + "\n"


def render_sweep(points: list[tuple[str, dict]], manifest: dict) -> str:
    head, rows = sweep_rows(points)
    w = manifest.get("workload", {})
    return (f"# flashlane bench sweep — {w.get('workload', '?')} on {manifest.get('model')}\n\n"
            + md_table(head, rows) + "\n\nPer-point details: see each load point's `report.md`.\n")
