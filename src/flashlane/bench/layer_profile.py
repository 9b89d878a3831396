"""Per-layer-type step breakdown from `flashlane profile`'s JSON summary, in words for the
compare explanation. bench only reads the JSON: the profiler runs as a separate command.

Accepted shapes: `flashlane profile`'s profile.json (``decode`` / ``prefill`` phases, each with
``categories: {layer type: {"ms", "share"}}``), or a top-level ``layer_types`` (or ``breakdown``)
that is either ``{name: {"time_s": t, "share": f}}`` or a list of ``{"name" | "layer_type": name,
"time_s" | "seconds" | "time_ms": t, "share"?: f}``; optional ``batch``, ``context``,
``step_time_s``. Shares are computed from times when absent; zero shares are dropped.
"""

from __future__ import annotations

from .report_rows import fmt


def _time_s(entry: dict) -> float | None:
    for key, scale in (("time_s", 1.0), ("seconds", 1.0), ("total_s", 1.0), ("time_ms", 1e-3),
                       ("ms", 1e-3)):
        v = entry.get(key)
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            return float(v) * scale
    return None


def has_layer_table(doc) -> bool:
    return isinstance(doc, dict) and (
        "layer_types" in doc or "breakdown" in doc
        or any(isinstance(doc.get(p), dict) and "categories" in doc[p] for p in ("decode", "prefill")))


def layer_shares(doc: dict, phase: str = "decode") -> list[tuple[str, float]]:
    """[(layer type, share of the step)], largest first; ValueError when the JSON has none.
    `phase` picks the decode or prefill table of a profile.json."""
    if not isinstance(doc, dict):
        raise ValueError("profile summary: not a JSON object")
    raw = doc.get("layer_types", doc.get("breakdown"))
    if raw is None and isinstance(doc.get(phase), dict):
        raw = doc[phase].get("categories")
    if isinstance(raw, dict):
        entries = [{"name": k, **(v if isinstance(v, dict) else {"time_s": v})} for k, v in raw.items()]
    elif isinstance(raw, list):
        entries = [e for e in raw if isinstance(e, dict)]
    else:
        raise ValueError("profile summary: no 'layer_types' table")
    rows = []
    for e in entries:
        name = e.get("name", e.get("layer_type"))
        if not name:
            raise ValueError("profile summary: a layer_types entry has no name")
        rows.append((str(name), e.get("share"), _time_s(e)))
    if any(share is None for _, share, _ in rows):
        total = sum(t or 0.0 for _, _, t in rows)
        if total <= 0:
            raise ValueError("profile summary: layer_types carry neither shares nor times")
        rows = [(n, (t or 0.0) / total, t) for n, _, t in rows]
    return sorted(((n, float(s)) for n, s, _ in rows if s and s > 0), key=lambda x: -x[1])


def breakdown_sentence(model: str, doc: dict, top: int = 4) -> str:
    """'At 8.2K context, batch 1, tiny-flash's decode step is 41% mhc, 22% kda, ... (profile).'"""
    shares = layer_shares(doc)
    ctx, batch = doc.get("context"), doc.get("batch")
    where = []
    if ctx:
        where.append(f"{fmt(ctx / 1000)}K context" if ctx >= 1000 else f"{ctx} context")
    if batch:
        where.append(f"batch {batch}")
    head = f"At {', '.join(where)}, " if where else ""
    parts = [f"{100 * s:.0f}% {n}" for n, s in shares[:top]]
    rest = sum(s for _, s in shares[top:])
    if rest > 0.005:
        parts.append(f"{100 * rest:.0f}% other")
    step = doc.get("step_time_s")
    tail = f" (step {fmt(step * 1000)} ms, `flashlane profile`)" if step else " (`flashlane profile`)"
    return f"{head}{model}'s decode step is " + ", ".join(parts) + tail + "."
