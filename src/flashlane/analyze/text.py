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


class _Table:
    """The lines of the report being built: rows of one value per model (plus the ratio column
    when two models are compared), section headings and free text."""

    def __init__(self, models: list[dict]):
        self.ms, self.two = models, len(models) == 2
        self.lines: list = ratio_legend(models[0]["name"], models[1]["name"]) if self.two else []

    def add(self, label, get, fmt, ratio=True, rate=False):
        vals = [get(m) for m in self.ms]
        r = None
        if self.two:
            numbers = all(isinstance(v, (int, float)) for v in vals)
            r = fmt_ratio(vals[1] / vals[0]) if ratio and numbers and vals[0] and vals[1] else "-"
        self.lines.append(_Row(label, ["n/a" if v is None else fmt(v) for v in vals], r,
                               rate and r not in (None, "-")))

    def fixed(self, label: str, values: list[str]):
        """A row of ready-made cells with no ratio."""
        self.lines.append(_Row(label, values, "-" if self.two else None))

    def section(self, title: str):
        self.lines.append("")
        self.lines.append(f"-- {title}")

    def note_last(self, text: str):
        self.lines[-1].note += text


def _layers_and_params(t: _Table):
    ms = t.ms
    t.section("layers")
    t.fixed("layers (KDA / DSA / attn)", [f"{m['layers']['kda']}/{m['layers']['dsa']}/{m['layers']['attn']}"
                                          for m in ms])
    t.add("full indexer layers", lambda m: m["layers"]["full_indexer"], str)
    t.fixed("MoE / dense FFN layers", [f"{m['layers']['moe']}/{m['layers']['dense']}" for m in ms])
    t.section("parameters")
    t.add("total (with MTP)", lambda m: m["params"]["total"], fmt_params)
    t.add("total without MTP", lambda m: m["params"]["total_without_mtp"], fmt_params)
    t.add("active per token", lambda m: m["params"]["active"], fmt_params)
    comps = [c for c in COMPONENTS if any(c in m["params"]["by_component"] for m in ms)]
    for c in comps:
        t.add(f"  {c} (total)", lambda m, c=c: m["params"]["by_component"].get(c, {}).get("total", 0), fmt_params)


def _cache_and_state(t: _Table, kv: str):
    t.section("cache and state")
    for f in KV_FORMATS:
        t.add(f"cache bytes/token {f}", lambda m, f=f: m["cache"]["bytes_per_token"][f], fmt_bytes)
    t.add(f"  latent bytes/token {kv}", lambda m: m["cache"]["latent_bytes_per_token"][kv], fmt_bytes)
    t.add(f"  indexer bytes/token {kv}", lambda m: m["cache"]["index_bytes_per_token"][kv], fmt_bytes)
    pools = dict.fromkeys(p for m in t.ms for p in m["cache"]["pool_bytes_per_token"].get(kv, {}))
    for pool in pools:    # the engine's own pools (bf16 / int8 only: fp8 is not an engine format)
        t.add(f"    pool {pool} bytes/token {kv}",
              lambda m, pool=pool: m["cache"]["pool_bytes_per_token"][kv].get(pool, 0), fmt_bytes)
    t.add("state bytes/sequence", lambda m: m["state"]["bytes_per_sequence"], fmt_bytes)
    t.add("+ speculative rollback/sequence", lambda m: m["state"]["speculative_rollback_bytes_per_sequence"],
          fmt_bytes)
    t.add("+ verify states/sequence/draft (graphs)",
          lambda m: m["state"]["speculative_verify_state_bytes_per_sequence_per_draft"], fmt_bytes)


def _flops(t: _Table, ctxs: list[str]):
    t.section("FLOPs per decode token")
    for c in ctxs:
        t.add(f"attention @{tokens_label(int(c))}", lambda m, c=c: m["flops"]["attention_per_token"][c], fmt_flops)
        for part, label in (("indexer_scoring", "indexer scoring"), ("sparse_attention", "sparse/dense attn"),
                            ("kda_recurrence", "KDA recurrence")):
            t.add(f"  {label}", lambda m, c=c, part=part: m["flops"]["by_component"][c][part], fmt_flops)
    first = ctxs[0]
    for part, label in (("projections", "mixer/indexer projections"), ("ffn", "FFN + experts + router"),
                        ("mhc", "mHC"), ("head", "LM head")):
        t.add(f"{label} (any context)", lambda m, part=part: m["flops"]["by_component"][first][part], fmt_flops)
    for c in ctxs:
        t.add(f"total @{tokens_label(int(c))}", lambda m, c=c: m["flops"]["total_per_token"][c], fmt_flops)
    for c in ctxs:
        t.add(f"prefill of {tokens_label(int(c))} prompt", lambda m, c=c: m["flops"]["prefill"][c], fmt_flops)


def _memory(t: _Table, report: dict, ctxs: list[str]):
    s = report["setup"]
    t.section(f"memory per device ({s['devices']} x {report['hardware']['name']}, weights {s['weight_dtype']}, "
              f"KV {s['kv_dtype']})")
    t.add("weights per device", lambda m: m["memory"]["weights_per_device"], fmt_bytes)
    t.fixed("fits", ["yes" if m["memory"]["fits"] else "NO" for m in t.ms])
    t.add("KV tokens per replica", lambda m: m["memory"]["kv_tokens_per_replica"], lambda v: f"{v:,}", rate=True)
    for c in ctxs:
        t.add(f"max sequences @{tokens_label(int(c))}", lambda m, c=c: m["memory"]["max_sequences"][c],
              lambda v: f"{v:,}", rate=True)


def _roofline(t: _Table, s: dict, ctxs: list[str]):
    t.section(f"roofline ({s['mfu']:.0%} FLOP/s, {s['mbu']:.0%} bandwidth)")
    for c in ctxs:
        t.add(f"decode tok/s B=1 @{tokens_label(int(c))}",
              lambda m, c=c: m["roofline"]["decode"][c]["batch1"]["tokens_per_s"], fmt_number, rate=True)
        if not all(m["roofline"]["decode"][c]["batch1"]["fits"] for m in t.ms):
            t.note_last("   (does not fit in memory: ideal rate shown)")
    for c in ctxs:
        t.add(f"decode tok/s B<={s['batch']} @{tokens_label(int(c))}",
              lambda m, c=c: m["roofline"]["decode"][c]["batch"]["tokens_per_s"], fmt_number, rate=True)
        t.note_last("   B=" + "/".join(str(m["roofline"]["decode"][c]["batch"]["size"]) for m in t.ms))
    for c in ctxs:
        t.add(f"prefill/TTFT {tokens_label(int(c))} prompt", lambda m, c=c: m["roofline"]["prefill"][c]["seconds"],
              fmt_seconds)
    if any(m["roofline"].get("speculative_mtp") for m in t.ms):
        for c in ctxs:
            for key, label in (("batch1", "B=1"), ("batch", f"B<={s['batch']}")):
                t.add(f"MTP k=3 decode speedup {label} @{tokens_label(int(c))}",
                      lambda m, c=c, k=key: _speedup(m["roofline"].get("speculative_mtp"), c, k), fmt_number,
                      rate=True)


def _speedup(spec: dict | None, ctx: str, key: str) -> float | None:
    row = (spec or {}).get(ctx, {}).get(key)
    return row["speedup"] if row else None


def _task(t: _Table, description: str):
    t.section(f"task: {description}")
    for m in t.ms:
        if not m["roofline"]["task"]["fits"]:
            t.lines.append(f"({m['name']}: the task's context does not fit in memory; times are ideal)")
    for key, label in (("c1", "concurrency 1"), ("cB", "concurrency B")):
        t.add(f"task time, {label}", lambda m, k=key: m["roofline"]["task"][k]["latency_s"], fmt_seconds)
        t.add(f"  mean TTFT, {label}", lambda m, k=key: m["roofline"]["task"][k]["mean_ttft_s"], fmt_seconds)
        t.add(f"  tasks/hour/replica, {label}", lambda m, k=key: m["roofline"]["task"][k]["tasks_per_hour"],
              fmt_number, rate=True)
        t.add(f"  $ per task, {label}", lambda m, k=key: m["roofline"]["task"][k]["usd_per_task"], fmt_usd)
    t.note_last("   B=" + "/".join(str(m["roofline"]["task"]["cB"]["concurrency"]) for m in t.ms))


def _claims(claims: list[dict]) -> list[str]:
    if not claims:
        return []
    lines = ["", "== public claims (ratios are baseline/model)"]
    for c in claims:
        lines.append(f"* \"{c['claim']}\": {c['verdict']}")
        for d in c["definitions"]:
            vals = ", ".join(_claim_value(k, v) for k, v in d["values"].items())
            mark = "REPRODUCES" if d["reproduces"] else ("~" + f"{TOLERANCE:.0%}" if d["approximately"] else "no")
            at = f"; equals the claim at {d['equal_at_context']:,} tokens" if d["equal_at_context"] else ""
            lines.append(f"    - [{mark}] {d['definition']}: {vals}{at}")
    return lines


def render_text(report: dict) -> str:
    t = _Table(report["models"])
    t.lines.append(_Row("", [m["name"] for m in t.ms], "baseline/model" if t.two else None))
    t.lines.append(_Row("", [m["arch"] for m in t.ms], "" if t.two else None))
    ctxs = [str(c) for c in report["contexts"]]
    _layers_and_params(t)
    _cache_and_state(t, report["setup"]["kv_dtype"])
    _flops(t, ctxs)
    _memory(t, report, ctxs)
    _roofline(t, report["setup"], ctxs)
    _task(t, report["task"]["description"])
    t.lines.extend(_claims(report["claims"]))
    t.lines.extend(["", "== assumptions"])
    t.lines.extend(f"- {a}" for a in report["assumptions"])
    return "\n".join(_layout(t.lines))


def _claim_value(key: str, v) -> str:
    if v is None:
        return "n/a"
    text = fmt_params(v) if v > 1e6 else f"{v:.3g}x"
    return text if key == "-" else f"{text} @{tokens_label(int(key))}"
