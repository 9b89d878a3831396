"""Self-contained HTML reports (plots embedded as base64 PNG)."""

from __future__ import annotations

import base64
import html

from .report_rows import load_label, run_rows, sweep_rows

STYLE = """body{font-family:system-ui,sans-serif;margin:2em;max-width:1200px;color:#222}
table{border-collapse:collapse;margin:1em 0}td,th{border:1px solid #ccc;padding:4px 8px;text-align:left;
font-size:14px}th{background:#f0f0f0}img{max-width:100%;display:block;margin:1em 0}
.bad{color:#b00}.note{color:#555;font-size:14px}"""


def img(png: bytes, alt: str) -> str:
    return (f'<img alt="{html.escape(alt)}" class="plot" '
            f'src="data:image/png;base64,{base64.b64encode(png).decode()}">')


def table(head: list[str] | None, rows: list[list[str]]) -> str:
    out = ["<table>"]
    if head:
        out.append("<tr>" + "".join(f"<th>{html.escape(str(h))}</th>" for h in head) + "</tr>")
    for r in rows:
        out.append("<tr>" + "".join(f"<td>{html.escape(str(c))}</td>" for c in r) + "</tr>")
    out.append("</table>")
    return "".join(out)


def page(title: str, sections: list[tuple[str, str]]) -> str:
    body = "".join(f"<h2>{html.escape(h)}</h2>\n{content}\n" for h, content in sections)
    return (f"<!DOCTYPE html><html><head><meta charset='utf-8'><title>{html.escape(title)}</title>"
            f"<style>{STYLE}</style></head><body><h1>{html.escape(title)}</h1>\n{body}</body></html>\n")


def render_run(summary: dict, manifest: dict, plots: dict[str, bytes]) -> str:
    meta = [["target", manifest.get("base_url")], ["model", manifest.get("model")],
            ["workload", manifest.get("workload", {}).get("workload")], ["mode", summary["mode"]],
            ["load point", load_label(summary["load_point"])], ["seed", manifest.get("seed")],
            ["started (UTC)", manifest.get("start_utc")]]
    sections = [("Run", table(None, meta)), ("Metrics", table(["metric", "value"], [list(r) for r in run_rows(summary)]))]
    sections += [(name, img(png, name)) for name, png in plots.items()]
    return page(f"flashlane bench — {manifest.get('model')} {load_label(summary['load_point'])}", sections)


def render_sweep(points: list[tuple[str, dict]], manifest: dict, plots: dict[str, bytes]) -> str:
    head, rows = sweep_rows(points)
    sections = [("Load points", table(head, rows))] + [(n, img(p, n)) for n, p in plots.items()]
    return page(f"flashlane bench sweep — {manifest.get('model')}", sections)
