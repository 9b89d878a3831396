"""Render a report dict as a side-by-side table with ratios, the claims and the assumptions."""

from __future__ import annotations

from .cache import KV_FORMATS
from .claims import TOLERANCE
from .params import COMPONENTS
from .units import fmt_bytes, fmt_flops, fmt_number, fmt_params, fmt_ratio, fmt_seconds, fmt_usd, tokens_label


RATE_MARK = "^"


class _Row:
    """One table row; the widths are fixed once every row is known (see ``_layout``)."""

    def __init__(self, label: str, values: list[str], ratio: str | None = None, rate: bool = False):
        self.label, self.values, self.ratio, self.rate, self.note = label, values, ratio, rate, ""


def _layout(lines: list) -> list[str]:
    """Rows padded to the widest label and the widest cell, so every column lines up."""
    rows = [r for r in lines if isinstance(r, _Row)]
    label_w = max(len(r.label) for r in rows) + 2
    cell_w = max(len(c) for r in rows for c in r.values + [r.ratio or ""]) + 3
    out = []
    for r in lines:
        if not isinstance(r, _Row):
            out.append(r)
            continue
        text = r.label.ljust(label_w) + "".join(v.rjust(cell_w) for v in r.values)
        if r.ratio is not None:
            text += r.ratio.rjust(cell_w) + (" " + RATE_MARK if r.rate else "  ")
        out.append((text + r.note).rstrip())
    return out


def ratio_legend(model: str, baseline: str) -> list[str]:
    """How the ratio column reads, said once above the table."""
    return [f"ratios: baseline / model = {baseline} / {model} (above 1x: {baseline} has more)",
            f"  costs (parameters, bytes, FLOPs, seconds, $): above 1x favours {model}",
            f"  rates (rows marked {RATE_MARK}: tok/s, tokens and sequences that fit, tasks/hour): "
            f"above 1x favours {baseline}",
            ""]


def render_text(report: dict) -> str:
    ms = report["models"]
    two = len(ms) == 2
    lines: list = ratio_legend(ms[0]["name"], ms[1]["name"]) if two else []
    lines.append(_Row("", [m["name"] for m in ms], "baseline/model" if two else None))
    lines.append(_Row("", [m["arch"] for m in ms], "" if two else None))

    def add(label, get, fmt, ratio=True, rate=False):
        vals = [get(m) for m in ms]
        r = None
        if two:
            numbers = all(isinstance(v, (int, float)) for v in vals)
            r = fmt_ratio(vals[1] / vals[0]) if ratio and numbers and vals[0] and vals[1] else "-"
        lines.append(_Row(label, ["n/a" if v is None else fmt(v) for v in vals], r, rate and r not in (None, "-")))

    def section(title):
        lines.append("")
        lines.append(f"-- {title}")

    section("layers")
    add("layers (KDA / DSA / attn)", lambda m: m["layers"]["total"],
        lambda v: str(v), ratio=False)
    lines[-1] = _Row("layers (KDA / DSA / attn)", [f"{m['layers']['kda']}/{m['layers']['dsa']}/{m['layers']['attn']}"
                                                    for m in ms], "-" if two else None)
    add("full indexer layers", lambda m: m["layers"]["full_indexer"], str)
    add("MoE / dense FFN layers", lambda m: m["layers"]["moe"], str, ratio=False)
    lines[-1] = _Row("MoE / dense FFN layers", [f"{m['layers']['moe']}/{m['layers']['dense']}" for m in ms],
                     "-" if two else None)
    section("parameters")
    add("total (with MTP)", lambda m: m["params"]["total"], fmt_params)
    add("total without MTP", lambda m: m["params"]["total_without_mtp"], fmt_params)
    add("active per token", lambda m: m["params"]["active"], fmt_params)
    comps = [c for c in COMPONENTS if any(c in m["params"]["by_component"] for m in ms)]
    for c in comps:
        add(f"  {c} (total)", lambda m, c=c: m["params"]["by_component"].get(c, {}).get("total", 0), fmt_params)
    section("cache and state")
    for f in KV_FORMATS:
        add(f"cache bytes/token {f}", lambda m, f=f: m["cache"]["bytes_per_token"][f], fmt_bytes)
    kv = report["setup"]["kv_dtype"]
    add(f"  latent bytes/token {kv}", lambda m: m["cache"]["latent_bytes_per_token"][kv], fmt_bytes)
    add(f"  indexer bytes/token {kv}", lambda m: m["cache"]["index_bytes_per_token"][kv], fmt_bytes)
    pools = dict.fromkeys(p for m in ms for p in m["cache"]["pool_bytes_per_token"].get(kv, {}))
    for pool in pools:    # the engine's own pools (bf16 / int8 only: fp8 is not an engine format)
        add(f"    pool {pool} bytes/token {kv}",
            lambda m, pool=pool: m["cache"]["pool_bytes_per_token"][kv].get(pool, 0), fmt_bytes)
    add("state bytes/sequence", lambda m: m["state"]["bytes_per_sequence"], fmt_bytes)
    ctxs = [str(t) for t in report["contexts"]]
    section("FLOPs per decode token")
    for t in ctxs:
        add(f"attention @{tokens_label(int(t))}", lambda m, t=t: m["flops"]["attention_per_token"][t], fmt_flops)
        for part, label in (("indexer_scoring", "indexer scoring"), ("sparse_attention", "sparse/dense attn"),
                            ("kda_recurrence", "KDA recurrence")):
            add(f"  {label}", lambda m, t=t, part=part: m["flops"]["by_component"][t][part], fmt_flops)
    first = ctxs[0]
    for part, label in (("projections", "mixer/indexer projections"), ("ffn", "FFN + experts + router"),
                        ("mhc", "mHC"), ("head", "LM head")):
        add(f"{label} (any context)", lambda m, part=part: m["flops"]["by_component"][first][part], fmt_flops)
    for t in ctxs:
        add(f"total @{tokens_label(int(t))}", lambda m, t=t: m["flops"]["total_per_token"][t], fmt_flops)
    for t in ctxs:
        add(f"prefill of {tokens_label(int(t))} prompt", lambda m, t=t: m["flops"]["prefill"][t], fmt_flops)
    s = report["setup"]
    section(f"memory per device ({s['devices']} x {report['hardware']['name']}, weights {s['weight_dtype']}, "
            f"KV {s['kv_dtype']})")
    add("weights per device", lambda m: m["memory"]["weights_per_device"], fmt_bytes)
    lines.append(_Row("fits", ["yes" if m["memory"]["fits"] else "NO" for m in ms], "-" if two else None))
    add("KV tokens per replica", lambda m: m["memory"]["kv_tokens_per_replica"], lambda v: f"{v:,}", rate=True)
    for t in ctxs:
        add(f"max sequences @{tokens_label(int(t))}", lambda m, t=t: m["memory"]["max_sequences"][t],
            lambda v: f"{v:,}", rate=True)
    section(f"roofline ({s['mfu']:.0%} FLOP/s, {s['mbu']:.0%} bandwidth)")
    for t in ctxs:
        add(f"decode tok/s B=1 @{tokens_label(int(t))}",
            lambda m, t=t: m["roofline"]["decode"][t]["batch1"]["tokens_per_s"], fmt_number, rate=True)
        if not all(m["roofline"]["decode"][t]["batch1"]["fits"] for m in ms):
            lines[-1].note += "   (does not fit in memory: ideal rate shown)"
    for t in ctxs:
        add(f"decode tok/s B<={s['batch']} @{tokens_label(int(t))}",
            lambda m, t=t: m["roofline"]["decode"][t]["batch"]["tokens_per_s"], fmt_number, rate=True)
        lines[-1].note += "   B=" + "/".join(str(m["roofline"]["decode"][t]["batch"]["size"]) for m in ms)
    for t in ctxs:
        add(f"prefill/TTFT {tokens_label(int(t))} prompt", lambda m, t=t: m["roofline"]["prefill"][t]["seconds"],
            fmt_seconds)
    section(f"task: {report['task']['description']}")
    for m in ms:
        if not m["roofline"]["task"]["fits"]:
            lines.append(f"({m['name']}: the task's context does not fit in memory; times are ideal)")
    for key, label in (("c1", "concurrency 1"), ("cB", "concurrency B")):
        add(f"task time, {label}", lambda m, k=key: m["roofline"]["task"][k]["latency_s"], fmt_seconds)
        add(f"  mean TTFT, {label}", lambda m, k=key: m["roofline"]["task"][k]["mean_ttft_s"], fmt_seconds)
        add(f"  tasks/hour/replica, {label}", lambda m, k=key: m["roofline"]["task"][k]["tasks_per_hour"],
            fmt_number, rate=True)
        add(f"  $ per task, {label}", lambda m, k=key: m["roofline"]["task"][k]["usd_per_task"], fmt_usd)
    lines[-1].note += "   B=" + "/".join(str(m["roofline"]["task"]["cB"]["concurrency"]) for m in ms)
    if report["claims"]:
        lines.append("")
        lines.append("== public claims (ratios are baseline/model)")
        for c in report["claims"]:
            lines.append(f"* \"{c['claim']}\": {c['verdict']}")
            for d in c["definitions"]:
                vals = ", ".join(_claim_value(k, v) for k, v in d["values"].items())
                mark = "REPRODUCES" if d["reproduces"] else ("~" + f"{TOLERANCE:.0%}" if d["approximately"] else "no")
                at = f"; equals the claim at {d['equal_at_context']:,} tokens" if d["equal_at_context"] else ""
                lines.append(f"    - [{mark}] {d['definition']}: {vals}{at}")
    lines.append("")
    lines.append("== assumptions")
    lines.extend(f"- {a}" for a in report["assumptions"])
    return "\n".join(_layout(lines))


def _claim_value(key: str, v) -> str:
    if v is None:
        return "n/a"
    text = fmt_params(v) if v > 1e6 else f"{v:.3g}x"
    return text if key == "-" else f"{text} @{tokens_label(int(key))}"
