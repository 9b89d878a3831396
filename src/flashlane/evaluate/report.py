"""The evaluation as a table (Markdown, terminal), and an HTML page with the Pareto plot."""

from __future__ import annotations

import base64
import html
import io
import json
from pathlib import Path

COLUMNS = [  # (header, key, format)
    ("configuration", "label", "{}"), ("perplexity", "perplexity", "{:.4g}"),
    ("top-1 agree", "top1_agreement", "{:.4f}"), ("KL mean", "kl_mean", "{:.3g}"), ("KL p99", "kl_p99", "{:.3g}"),
    ("greedy prefix", "greedy_prefix_agreement", "{:.3f}"), ("weights MB", "weight_mb", "{:.1f}"),
    ("cache B/token", "cache_bytes_per_token", "{:g}"), ("prefill tok/s", "prefill_tok_s", "{:.0f}"),
    ("decode tok/s b1", "decode_tok_s_b1", "{:.1f}"), ("decode tok/s b16", "decode_tok_s_b16", "{:.1f}"),
]
RANDOM_NOTE = ("Random-weight model: its perplexity measures nothing about language; only agreement and KL "
               "against the reference are meaningful.")


def all_rows(result: dict) -> list[dict]:
    return [result["reference"]] + result["configurations"]


def _cell(row: dict, key: str, fmt: str) -> str:
    v = row["weight_bytes"] / 1e6 if key == "weight_mb" else row.get(key)
    return "-" if v is None else fmt.format(v)


def table_rows(result: dict) -> tuple[list[str], list[list[str]]]:
    return [c[0] for c in COLUMNS], [[_cell(r, k, f) for _, k, f in COLUMNS] for r in all_rows(result)]


def pareto_front(points: list[tuple[float, float]]) -> list[int]:
    """Indices of points no other point beats on both axes (higher is better on both)."""
    return [i for i, (x, y) in enumerate(points)
            if not any((ox >= x and oy >= y) and (ox > x or oy > y) for ox, oy in points)]


def notes(result: dict) -> list[str]:
    out = [result["method"]]
    if any(r.get("random_weights") for r in all_rows(result)):
        out.append(RANDOM_NOTE)
    m = result["machine"]
    out.append(f"Machine: {m['cpu_model']} ({m['cpu_capability']}), {m['torch_threads']} torch threads, torch {m['torch']}. "
               f"Corpus: {result['corpus']['name']}, {result['corpus']['tokens']} tokens, "
               f"{result['corpus']['windows']} windows of {result['corpus']['window']}.")
    return out


def markdown(result: dict) -> str:
    head, rows = table_rows(result)
    lines = [f"# flashlane eval — {result['model']}", ""]
    lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    lines += [""] + [f"- {n}" for n in notes(result)]
    return "\n".join(lines) + "\n"


def pareto_png(result: dict) -> bytes:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = all_rows(result)
    speed_key = "decode_tok_s_b1" if all(r.get("decode_tok_s_b1") for r in rows) else None
    xs = [r[speed_key] if speed_key else r["weight_bytes"] / 1e6 for r in rows]
    ys = [r["top1_agreement"] for r in rows]
    mb = [r["weight_bytes"] / 1e6 for r in rows]
    fig, ax = plt.subplots(figsize=(8, 5))
    biggest = max(mb) or 1.0
    sc = ax.scatter(xs, ys, s=[60 + 400 * m / biggest for m in mb], c=mb, cmap="viridis", alpha=0.8,
                    edgecolors="black")
    fig.colorbar(sc, ax=ax, label="weights (MB)")
    front = sorted(pareto_front(list(zip(xs, ys))), key=lambda i: xs[i])
    ax.plot([xs[i] for i in front], [ys[i] for i in front], "--", color="grey", label="Pareto front")
    for x, y, r in zip(xs, ys, rows):
        ax.annotate(r["label"], (x, y), fontsize=7, xytext=(4, 4), textcoords="offset points")
    ax.set_xlabel("decode tok/s, batch 1" if speed_key else "weights (MB)")
    ax.set_ylabel("top-1 agreement with the reference")
    ax.legend(loc="best")
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=90, bbox_inches="tight")
    plt.close(fig)
    return buf.getvalue()


def html_page(result: dict) -> str:
    head, rows = table_rows(result)
    table = ("<table><tr>" + "".join(f"<th>{html.escape(h)}</th>" for h in head) + "</tr>"
             + "".join("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in r) + "</tr>" for r in rows)
             + "</table>")
    png = base64.b64encode(pareto_png(result)).decode()
    title = html.escape(f"flashlane eval — {result['model']}")
    return ("<!DOCTYPE html><html><head><meta charset='utf-8'><title>" + title + "</title><style>"
            "body{font-family:system-ui,sans-serif;margin:2em;max-width:1200px}table{border-collapse:collapse}"
            "td,th{border:1px solid #ccc;padding:4px 8px;font-size:14px}th{background:#f0f0f0}</style></head>"
            f"<body><h1>{title}</h1><h2>Configurations</h2>{table}<h2>Accuracy retained vs speed</h2>"
            f"<img alt='Pareto plot' src='data:image/png;base64,{png}'>"
            + "".join(f"<p>{html.escape(n)}</p>" for n in notes(result)) + "</body></html>\n")


def write_reports(result: dict, out_dir: str | Path) -> list[Path]:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = [out / "eval.json", out / "eval.md", out / "eval.html"]
    paths[0].write_text(json.dumps(result, indent=2) + "\n")
    paths[1].write_text(markdown(result))
    paths[2].write_text(html_page(result))
    return paths
