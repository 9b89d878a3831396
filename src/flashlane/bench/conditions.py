"""The serving conditions a server reports about itself, and where two servers differ.

`compare` measures two servers side by side; a gap in their speeds means little if one ran
bfloat16 and the other float32, or with a different thread count. flashlane's `/v1/models`
card carries them under a `flashlane` key (other servers: whatever they report, else None).
Only HTTP documents are read here: nothing from the engine or the models.
"""

from __future__ import annotations

FIELDS = ("dtype", "num_threads", "quantization", "kv_cache_dtype", "linear_kernel")


def _find_report(doc) -> dict | None:
    """The first dict under a key named "flashlane", depth first (data[0]["flashlane"] for flashlane)."""
    if isinstance(doc, dict):
        if isinstance(doc.get("flashlane"), dict):
            return doc["flashlane"]
        children = doc.values()
    elif isinstance(doc, list):
        children = doc
    else:
        return None
    for child in children:
        found = _find_report(child)
        if found is not None:
            return found
    return None


def _quantization(q) -> str | None:
    """A short readable form: "none", "int8 (linears, experts, head)", "gguf Q4_1", or the text given
    (which kinds of weights were quantised, not how many: two models of different sizes compare)."""
    if q is None:
        return "none"
    if isinstance(q, str):
        return q or "none"
    if not isinstance(q, dict):
        return str(q)
    method = q.get("method") or q.get("type") or q.get("format") or "quantized"
    parts = [str(method)]
    if q.get("quant_type"):
        parts.append(str(q["quant_type"]))
    covered = [name for name in ("linears", "experts", "head", "embeddings") if q.get(name)]
    text = " ".join(parts)
    return f"{text} ({', '.join(covered)})" if covered else text


def server_conditions(models_doc: dict | None) -> dict:
    """{"dtype", "num_threads", "quantization", "kv_cache_dtype", "linear_kernel"} (the float
    linears' weight format) as the server's /v1/models document reports them; each None when it
    is not reported."""
    report = _find_report(models_doc)
    if report is None:
        return dict.fromkeys(FIELDS)
    out = {k: report.get(k) for k in ("dtype", "num_threads", "kv_cache_dtype")}
    # a flashlane report always holds the key (None: no quantization); a missing key is unknown
    out["quantization"] = _quantization(report["quantization"]) if "quantization" in report else None
    out["linear_kernel"] = (report.get("linear_kernel") or {}).get("format")
    return {k: out[k] for k in FIELDS}


def differing(a: dict, b: dict) -> list[str]:
    """The fields both sides report with different values."""
    return [k for k in FIELDS if a.get(k) is not None and b.get(k) is not None and a[k] != b[k]]


def mismatches(a: dict, b: dict) -> list[str]:
    """One line per field both sides report with different values, e.g. "dtype bfloat16 vs float32"."""
    return [f"{k} {a[k]} vs {b[k]}" for k in differing(a, b)]
