"""Sparse MLA prefill on CPU: the absorbed form (kernels/sparse_mla.py, with the W_k fold and the W_v
product the op does around it) vs the expanded form (kernels/sparse_mla_expanded.py).

Shapes from the tiny-standard and tiny-flash presets' configs; one sequence whose last ``n`` tokens
are the chunk at context ``ctx`` (chunk sizes 16..2048, contexts 1K..16K, plus each chunk as a
sequence's first chunk, ctx = n), each query selecting a random duplicate-free set of ``width``
positions up to its own. The two forms run interleaved (ABAB) ``--repeats`` times; every row has
both medians, the median paired ratio expanded / absorbed, each form's FLOPs, the cost rule's
choice and the measured one. The summary fits ``EXPANDED_FLOP_COST`` (median over rows of the
expanded form's time per FLOP over the absorbed form's) and says where the rule with that constant
would disagree with the measurement.

    python benchmarks/mla_forms.py --repeats 5
    python benchmarks/mla_forms.py --presets tiny-standard --chunks 16,256 --contexts 1024 --repeats 3
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch
from common import write_result

from flashlane.config import parse_config
from flashlane.kernels import sparse_mla_expanded as expanded_mod
from flashlane.kernels.backends import CpuBackend
from flashlane.kernels.indexer import selection_width
from flashlane.kernels.sparse_mla_expanded import (
    dense_path,
    mla_form_flops,
    prefer_expanded,
    sparse_mla_expanded,
)
from flashlane.presets import preset_config

PAGE = 64


def cpu_name() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return "unknown"


def shape(preset: str) -> dict:
    cfg = parse_config(preset_config(preset))
    return {"heads": cfg.num_heads, "kv_rank": cfg.kv_lora_rank, "rope_dim": cfg.qk_rope_head_dim,
                "nope_dim": cfg.qk_nope_head_dim, "v_dim": cfg.v_head_dim,
                "topk": selection_width(cfg.index_topk, cfg.index_kpool, cfg.index_always_select_tail)}


def case(s: dict, n: int, ctx: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    h, c, r, dn, dv, k = (s[x] for x in ("heads", "kv_rank", "rope_dim", "nope_dim", "v_dim", "topk"))
    pages = (ctx + PAGE - 1) // PAGE
    latent = torch.randn((pages + 1) * PAGE, c + r, generator=g)
    tables = (torch.randperm(pages, generator=g) + 1)[None]
    pos = torch.arange(ctx - n, ctx)
    score = torch.rand(n, ctx, generator=g).masked_fill(torch.arange(ctx)[None] > pos[:, None], -1.0)
    top = score.topk(min(k, ctx), dim=-1)
    sel = torch.full((n, k), -1, dtype=torch.long)
    sel[:, : top.indices.shape[1]] = top.indices.masked_fill(top.values < 0, -1)
    meta = {"block_tables": tables, "page_size": PAGE}
    q_nope = torch.randn(n, h, dn, generator=g)
    q_rope = torch.randn(n, h, r, generator=g) if r else None
    w_kv = torch.randn(h, dn + dv, c, generator=g) * c ** -0.5
    return q_nope, q_rope, latent, sel, w_kv, meta


def forms(q_nope, q_rope, latent, sel, w_kv, meta, scale: float):
    from types import SimpleNamespace

    n = q_nope.shape[0]
    m = SimpleNamespace(seq_of_token=torch.zeros(n, dtype=torch.long), **meta)
    absorbed = lambda: CpuBackend._sparse_mla_absorbed(
        q_nope, q_rope, latent, None, sel, m.seq_of_token, m, scale, w_kv)
    expanded = lambda: sparse_mla_expanded(
        q_nope, q_rope, latent, sel, w_kv, spans=[(0, n, 0)], block_tables=meta["block_tables"],
        page_size=PAGE, scale=scale, latent_scale=None)
    return absorbed, expanded


CLOCKS = {"thread": time.thread_time, "wall": time.perf_counter}


def timed(fn, clock, calls: int = 1) -> tuple[float, torch.Tensor]:
    """ms per call of ``calls`` back-to-back calls."""
    t0 = clock()
    for _ in range(calls):
        out = fn()
    return 1000 * (clock() - t0) / calls, out


def measure(preset: str, s: dict, n: int, ctx: int, repeats: int, clock, min_ms: float) -> dict:
    args = case(s, n, ctx)
    a_fn, e_fn = forms(*args, scale=(s["nope_dim"] + s["rope_dim"]) ** -0.5)
    t_a, a_out = timed(a_fn, clock)     # warm-up, and the outputs must agree
    t_e, e_out = timed(e_fn, clock)
    err = float((a_out - e_out).abs().max())
    # short calls are repeated within a sample so that a sample is not one clock tick
    calls_a, calls_e = (max(1, round(min_ms / max(t, 1e-3))) for t in (t_a, t_e))
    ta, te = [], []
    for _ in range(repeats):
        ta.append(timed(a_fn, clock, calls_a)[0])
        te.append(timed(e_fn, clock, calls_e)[0])
    ratio = statistics.median(e / a for a, e in zip(ta, te))
    distinct = int(torch.unique(args[3][args[3] >= 0]).numel())
    fa, fe = mla_form_flops(n, distinct, **s)      # what ran (the rule sees the bound min(ctx, n K))
    return {"preset": preset, "chunk": n, "ctx": ctx, "distinct_rows": distinct,
            "absorbed_ms": statistics.median(ta), "expanded_ms": statistics.median(te),
            "ratio_expanded_over_absorbed": ratio, "absorbed_flops": fa, "expanded_flops": fe,
            "expanded_path": "dense" if dense_path(distinct, s["topk"]) else "gathered", "max_abs_diff": err,
            "rule_expanded": prefer_expanded([(n, ctx)], **s), "measured_expanded": ratio < 1.0}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--presets", default="tiny-standard,tiny-flash")
    ap.add_argument("--chunks", default="16,64,256,1024,2048")
    ap.add_argument("--contexts", default="1024,4096,16384")
    ap.add_argument("--no-first-chunks", action="store_true", help="skip the ctx = n rows")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1, help="torch threads (0: leave as is; 1 on a shared machine)")
    ap.add_argument("--clock", choices=list(CLOCKS), default="thread",
                    help="thread: CPU time of this thread (with --threads 1, not the neighbours' load)")
    ap.add_argument("--min-ms", type=float, default=20.0, help="least time of one sample (short calls repeat)")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    chunks = [int(x) for x in a.chunks.split(",")]
    contexts = [int(x) for x in a.contexts.split(",")]
    rows = []
    with torch.no_grad():
        for preset in a.presets.split(","):
            s = shape(preset)
            points = [(n, ctx) for ctx in contexts for n in chunks if n <= ctx]
            if not a.no_first_chunks:
                points += [(n, n) for n in chunks]
            for n, ctx in points:
                row = measure(preset, s, n, ctx, a.repeats, CLOCKS[a.clock], a.min_ms)
                print(f"{preset:14s} n={n:5d} ctx={ctx:6d} d={row['distinct_rows']:6d} "
                      f"absorbed {row['absorbed_ms']:8.2f} ms  expanded {row['expanded_ms']:8.2f} ms  "
                      f"ratio {row['ratio_expanded_over_absorbed']:.2f} {row['expanded_path']:8s} "
                      f"rule={'E' if row['rule_expanded'] else 'A'}",
                      flush=True)
                rows.append(row)
    # per expanded path: what one of its FLOPs costs in absorbed-form FLOPs, as measured
    fitted = {}
    for path in ("dense", "gathered"):
        per = [(r["expanded_ms"] / r["expanded_flops"]) / (r["absorbed_ms"] / r["absorbed_flops"])
               for r in rows if r["expanded_path"] == path]
        fitted[path] = statistics.median(per) if per else None
    crossover = {}
    for preset in a.presets.split(","):
        for ctx in sorted({r["ctx"] for r in rows if r["preset"] == preset}):
            pts = [r for r in rows if r["preset"] == preset and r["ctx"] == ctx]
            crossover[f"{preset}@{ctx}"] = {
                "measured_expanded_chunks": [r["chunk"] for r in pts if r["measured_expanded"]],
                "rule_expanded_chunks": [r["chunk"] for r in pts if r["rule_expanded"]]}
    in_rule = {"dense": expanded_mod.EXPANDED_DENSE_FLOP_COST, "gathered": expanded_mod.EXPANDED_GATHERED_FLOP_COST}
    expanded_mod.EXPANDED_DENSE_FLOP_COST = fitted["dense"] or in_rule["dense"]
    expanded_mod.EXPANDED_GATHERED_FLOP_COST = fitted["gathered"] or in_rule["gathered"]
    disagree_fitted = [(r["preset"], r["chunk"], r["ctx"]) for r in rows
                       if prefer_expanded([(r["chunk"], r["ctx"])], **shape(r["preset"])) != r["measured_expanded"]]
    expanded_mod.EXPANDED_DENSE_FLOP_COST, expanded_mod.EXPANDED_GATHERED_FLOP_COST = in_rule.values()
    write_result("mla_forms", {
        "cpu": {"model_name": cpu_name(), "capability": torch.backends.cpu.get_cpu_capability(),
                "torch_threads": torch.get_num_threads()},
        "dtype": "float32", "page_size": PAGE, "repeats": a.repeats, "method": "ABAB interleaved, median per form",
        "clock": a.clock, "min_sample_ms": a.min_ms,
        "shapes": {p: shape(p) for p in a.presets.split(",")},
        "dense_rows_per_topk": expanded_mod.DENSE_ROWS_PER_TOPK,
        "expanded_flop_cost_in_rule": in_rule, "expanded_flop_cost_fitted": fitted,
        "rule_disagrees_with_measurement": [(r["preset"], r["chunk"], r["ctx"]) for r in rows
                                            if r["rule_expanded"] != r["measured_expanded"]],
        "fitted_rule_disagrees_with_measurement": disagree_fitted,
        "crossover": crossover, "rows": rows}, a.out)


if __name__ == "__main__":
    main()
